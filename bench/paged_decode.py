"""Paged decode: step time at held length l against a contiguous cache sized exactly l.

The engine's decode step over its page pool (max_len 16x the held length), against the same
model's decode step on a contiguous `[layers, slots, length, ...]` cache (a) sized exactly for
what the slots hold, the best any cache could do, and (b) sized max_len, what a cache reserved
for the worst case attends over every step. All run in this process with the same weights,
slots, held length and sampler; the script prints the ratios per held length.

    jaxrl bench paged_decode [--slots 32] [--lengths 64 256 1024]
    (or: .venv/bin/python bench/paged_decode.py ...)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from functools import partial

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxrl.models import ModelConfig, Transformer, merge_params, split_params  # noqa: E402
from jaxrl.models.kv_cache import ContiguousKV  # noqa: E402
from serving.runner.engine import Engine, EngineConfig, SlotBatch  # noqa: E402
from serving.runner.sampling import Draws, SamplingParams, sample, slot_keys  # noqa: E402


@partial(jax.jit, static_argnums=(0, 4), donate_argnums=2)
def contiguous_steps(graphdef, params, cache, tokens_S, steps, start_S):
    """`steps` greedy decode steps on a contiguous cache, sampled as the engine samples."""
    model = merge_params(graphdef, params)
    s = tokens_S.shape[0]
    greedy = (jnp.zeros(s), jnp.zeros(s, jnp.int32), jnp.ones(s))

    def body(carry, _):
        cache, tokens_S, lengths_S = carry
        x_S1D, cache = model.extend(tokens_S[:, None], lengths_S, cache)
        keys = slot_keys(jnp.zeros(s, jnp.uint32), jnp.zeros(s, jnp.int32), lengths_S)
        tokens_S, _ = sample(model.logits(x_S1D)[:, 0], Draws(*greedy, keys))
        return (cache, tokens_S, lengths_S + 1), tokens_S

    (cache, _, _), out = jax.lax.scan(body, (cache, tokens_S, start_S), length=steps)
    return cache, out


def best_per_step(fn, steps, repeats, reset=lambda: None):
    reset()
    jax.block_until_ready(fn())   # compile
    times = []
    for _ in range(repeats):
        reset()
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return min(times) / steps


def measure(model, args, held: int) -> dict:
    graphdef, params = split_params(model)
    cfg = model.cfg
    s, k, page = args.slots, args.steps, args.page_size
    # Paged: max_len 16x the held length; pages only for what the slots hold.
    sizes = EngineConfig(max_concurrent_decodes=s, max_len=16 * (held + k), max_prefill_length=8,
                         prefill_chunk=8, page_size=page, page_buckets=args.page_buckets)
    width = sizes.table_width(held + k)
    engine_cfg = dataclasses.replace(sizes, num_pages=max(s * width,
                                                          sizes.pages_per_sequence) + 1)
    engine = Engine(cfg, engine_cfg)
    placed = engine.prepare_params(params)
    table = 1 + np.arange(s * width, dtype=np.int32).reshape(s, width)
    greedy = [SamplingParams(temperature=0.0)] * s
    state = engine.init_decode_state()

    def rewind():   # every slot back to `held` tokens, outside the timed call
        nonlocal state
        state = jax.block_until_ready(engine.insert(state, SlotBatch(
            list(range(s)), [held] * s, [3] * s, [1] * s, greedy, [0] * s)))

    def paged():
        nonlocal state
        state, tokens, _ = engine.generate_steps(placed, state, table, k)
        return tokens

    tokens0, start = jnp.full((s,), 3, jnp.int32), jnp.full((s,), held, jnp.int32)

    def contiguous(length):
        """Decode on a contiguous cache of `length` positions per slot."""
        cache = ContiguousKV.zeros(cfg.num_layers, s, length, cfg.num_kv_heads, cfg.head_dim)

        def run():
            nonlocal cache
            cache, tokens = contiguous_steps(graphdef, placed, cache, tokens0, k, start)
            return tokens
        return run

    sides = {"paged": (paged, rewind), "exact": (contiguous(held + k), lambda: None),
             "reserved": (contiguous(engine_cfg.max_len), lambda: None)}
    rows = {}
    for _ in range(args.rounds):   # alternate the sides so that a noisy neighbour hits all
        for name, (fn, reset) in sides.items():
            rows.setdefault(name, []).append(best_per_step(fn, k, args.repeats, reset))
    p, c, r = (min(rows[n]) for n in ("paged", "exact", "reserved"))
    return {"held_len": held, "max_len": engine_cfg.max_len, "pages_read": width * page,
            "paged_step_ms": 1e3 * p, "contiguous_exact_step_ms": 1e3 * c,
            "contiguous_max_len_step_ms": 1e3 * r, "paged_vs_exact": p / c,
            "max_len_vs_paged": r / p}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--slots", type=int, default=32, help="sequences decoded together")
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024],
                    help="held lengths l (tokens already in every slot's cache)")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per timed dispatch")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    ap.add_argument("--page-buckets", type=int, default=4,
                    help="page-table widths per doubling (EngineConfig.page_buckets)")
    ap.add_argument("--repeats", type=int, default=5, help="timed dispatches per round")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of both sides")
    # The demo's shape (configs/demo_cpu.yaml) with a 1024-token vocabulary and room for 16x
    # the longest held length.
    ap.add_argument("--embed", type=int, default=128, help="model width (32-wide heads)")
    ap.add_argument("--layers", type=int, default=4, help="transformer layers")
    ap.add_argument("--vocab", type=int, default=1024, help="vocabulary size")
    args = ap.parse_args(argv)
    cfg = ModelConfig(vocab_size=args.vocab, embed_dim=args.embed, num_layers=args.layers,
                      num_heads=args.embed // 32, num_kv_heads=args.embed // 64, head_dim=32,
                      mlp_dim=3 * args.embed, max_seq_len=16 * (max(args.lengths) + args.steps))
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    print(f"model: {cfg.num_params() / 1e6:.1f}M params, float32; {args.slots} slots, pages of "
          f"{args.page_size}, {args.steps} steps per dispatch, {jax.devices()[0].platform}")
    results = []
    for held in args.lengths:
        r = measure(model, args, held)
        results.append(r)
        print(f"  l={held:<5} max_len {r['max_len']:<6} paged {r['paged_step_ms']:8.3f} ms | "
              f"contiguous sized l {r['contiguous_exact_step_ms']:8.3f} ms: paged "
              f"{r['paged_vs_exact']:.2f}x | contiguous sized max_len "
              f"{r['contiguous_max_len_step_ms']:8.3f} ms: {r['max_len_vs_paged']:.1f}x paged")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
