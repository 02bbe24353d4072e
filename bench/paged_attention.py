"""Paged attention on CPU: the engine's implementations side by side, and PyTorch's bar.

Four layers' attention over a page pool (`PagedKV.attend` in one jitted program, pages of 16
scattered over the pool as a running server leaves them) through `reference`, `loop` and
`native` (serving/runner/paged_kv.py), against PyTorch's `scaled_dot_product_attention` over a
contiguous cache holding the same tokens (what Hugging Face `generate` attends with). Every
implementation runs at every held length in one process, in alternating rounds; the script
prints milliseconds (medians) and each one's ratio to `native`, and checks that all agree.

    jaxrl bench paged_attention [--rows 128] [--lengths 65 300 529] [--queries 1]
    (or: .venv/bin/python bench/paged_attention.py ...)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _machine import best_seconds  # noqa: E402

from serving.runner.paged_kv import PagedKV  # noqa: E402

IMPLEMENTATIONS = ("reference", "loop", "native")
PAGE = 16


def problem(args, length: int, seed: int = 0):
    """A pool holding `rows` rows of `length` tokens (pages in random order), their queries at
    the last `queries` positions, and the same keys and values as contiguous arrays."""
    rng = np.random.default_rng(seed)
    g, n, h = args.kv_heads, args.heads, args.head_dim
    width = -(-length // PAGE)
    pages = args.rows * width + 1
    kv = rng.standard_normal((args.layers, pages, PAGE, 2 * g, h), np.float32)
    table = 1 + rng.permutation(args.rows * width).reshape(args.rows, width)
    q = rng.standard_normal((args.rows, args.queries, n, h), np.float32)
    positions = length - args.queries + np.arange(args.queries)[None].repeat(args.rows, 0)
    held = kv[:, table].reshape(args.layers, args.rows, width * PAGE, 2 * g, h)[:, :, :length]
    return ((jnp.asarray(kv), jnp.asarray(table, jnp.int32), jnp.asarray(q),
             jnp.asarray(positions, jnp.int32)), held, q)


def jax_side(impl: str, layers: int):
    def attend(kv, table, q, positions):
        cache = PagedKV(kv, table, impl)
        return sum(cache.attend(layer, q, positions) for layer in range(layers))
    return jax.jit(attend)


def torch_side(held, q):
    """PyTorch's attention over contiguous [rows, kv heads, length, H] keys and values."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    keys = [torch.from_numpy(np.ascontiguousarray(x[:, :, 0::2].transpose(0, 2, 1, 3)))
            for x in held]
    values = [torch.from_numpy(np.ascontiguousarray(x[:, :, 1::2].transpose(0, 2, 1, 3)))
              for x in held]
    query = torch.from_numpy(np.ascontiguousarray(q.transpose(0, 2, 1, 3)))
    t, length = q.shape[1], held.shape[2]
    mask = torch.arange(length)[None] <= torch.arange(length - t, length)[:, None]

    def attend():
        with torch.no_grad():
            return sum(torch.nn.functional.scaled_dot_product_attention(
                query, k, v, attn_mask=mask, enable_gqa=True) for k, v in zip(keys, values))
    return attend


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=128, help="rows (slots) attending together")
    ap.add_argument("--lengths", type=int, nargs="+", default=[65, 300, 529],
                    help="tokens each row holds")
    ap.add_argument("--queries", type=int, default=1,
                    help="queries a row (1: a decode step; more: a prefill chunk)")
    ap.add_argument("--heads", type=int, default=4, help="query heads")
    ap.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    ap.add_argument("--head-dim", type=int, default=64, help="head width")
    ap.add_argument("--layers", type=int, default=4, help="layers attended in one program")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of every side")
    ap.add_argument("--repeats", type=int, default=4, help="timed batches per side and round")
    ap.add_argument("--no-torch", action="store_true", help="leave PyTorch out")
    args = ap.parse_args()

    sides = [*IMPLEMENTATIONS, *([] if args.no_torch else ["torch"])]
    results = []
    for length in args.lengths:
        arrays, held, q = problem(args, length)
        calls = {impl: (lambda f=jax_side(impl, args.layers): f(*arrays))
                 for impl in IMPLEMENTATIONS}
        if not args.no_torch:
            calls["torch"] = torch_side(held, q)
        outs = {name: np.asarray(call(), np.float32) for name, call in calls.items()}
        if "torch" in outs:     # [rows, heads, queries, H] -> [rows, queries, heads, H]
            outs["torch"] = outs["torch"].transpose(0, 2, 1, 3)
        error = max(float(np.abs(outs[s] - outs["native"]).max()) for s in sides)
        times = {s: [] for s in sides}
        for _ in range(args.rounds):
            for s in sides:
                times[s].append(best_seconds(calls[s], args.repeats, 5) * 1e3)
        ms = {s: statistics.median(t) for s, t in times.items()}
        results.append({"length": length, "ms": ms, "max_abs_diff": error})
        print(f"{args.rows} rows x {args.queries} queries holding {length} tokens, "
              f"{args.layers} layers (largest difference from native {error:.1e}):")
        for s in sides:
            print(f"  {s:10s} {ms[s]:8.2f} ms   {ms[s] / ms['native']:5.2f}x native")
    print(json.dumps({"rows": args.rows, "queries": args.queries, "results": results}))


if __name__ == "__main__":
    main()
