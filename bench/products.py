"""Float32 matrix products on CPU: XLA:CPU against PyTorch at a train step's shapes.

A transformer's train step is mostly its weights' products: per layer, forward `x @ W`, and
backward `dy @ W.T` (the input's gradient) and `x.T @ dy` (the weight's). This script times
each form for every weight of a Llama layer at one microbatch's tokens, jitted by XLA:CPU (as
jaxrl's train step compiles it: with its YNNPACK fusions, and without them, the option
`jaxrl/train/step.py` picks for wide models) and in PyTorch (its BLAS, as TRL trains), in
alternating rounds in one process, and prints GFLOP/s and PyTorch's speed over XLA's. The
defaults are the 30M peer job's (bench/peers.py): 16 samples of 81 tokens, 576 wide.

    jaxrl bench products [--tokens 1296] [--hidden 576] [--mlp 1536] [--kv 288]
    (or: .venv/bin/python bench/products.py ...)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from _machine import best_seconds  # noqa: E402

FORMS = {   # name: (the product, its operands' shapes from (tokens, in, out))
    "x @ W": (lambda a, b: a @ b, lambda t, i, o: ((t, i), (i, o))),
    "dy @ W.T": (lambda a, b: a @ b.T, lambda t, i, o: ((t, o), (i, o))),
    "x.T @ dy": (lambda a, b: a.T @ b, lambda t, i, o: ((t, i), (t, o))),
}
XLA_SIDES = {"xla": None, "xla-no-ynn": {"xla_cpu_experimental_ynn_fusion_type": ""}}


def sides(form: str, a: np.ndarray, b: np.ndarray) -> dict:
    """{side: a call computing the product}, every side on the same operands."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    fn = FORMS[form][0]
    ja, jb = jax.numpy.asarray(a), jax.numpy.asarray(b)
    calls = {name: (lambda f=jax.jit(fn, compiler_options=opts): f(ja, jb))
             for name, opts in XLA_SIDES.items()}
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    calls["torch"] = lambda: fn(ta, tb)
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16 * 81, help="tokens in a microbatch")
    ap.add_argument("--hidden", type=int, default=576, help="the model's width")
    ap.add_argument("--mlp", type=int, default=1536, help="the MLP's width")
    ap.add_argument("--kv", type=int, default=288, help="the key (and value) projection's width")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of every side")
    ap.add_argument("--repeats", type=int, default=3, help="timed batches per side and round")
    args = ap.parse_args()

    # weight: (fan in, fan out, how many of it a layer has)
    weights = {"q/o": (args.hidden, args.hidden, 2), "k/v": (args.hidden, args.kv, 2),
               "gate/up": (args.hidden, args.mlp, 2), "down": (args.mlp, args.hidden, 1)}
    rng = np.random.default_rng(0)
    print(f"float32 products at {args.tokens} tokens, {os.cpu_count()} cores; GFLOP/s "
          f"(best of {args.repeats} x 10 calls, median of {args.rounds} rounds)")
    print(f"  {'weight':8s} {'form':9s} {'xla':>7s} {'no-ynn':>7s} {'torch':>7s} "
          f"{'torch / best xla':>16s}")
    rows, seconds = [], {"xla": 0.0, "xla-no-ynn": 0.0, "torch": 0.0}
    for weight, (fan_in, fan_out, count) in weights.items():
        for form, (_, shapes) in FORMS.items():
            a, b = (rng.standard_normal(s, np.float32)
                    for s in shapes(args.tokens, fan_in, fan_out))
            calls = sides(form, a, b)
            ref = np.asarray(calls["torch"](), np.float64)
            for name in XLA_SIDES:
                diff = np.abs(np.asarray(calls[name]()) - ref).max() / np.abs(ref).max()
                if diff > 1e-4:
                    raise SystemExit(f"{name} {weight} {form}: relative difference {diff:.1e}")
            times = {s: [] for s in calls}
            for _ in range(args.rounds):
                for s, call in calls.items():
                    times[s].append(best_seconds(call, args.repeats, 10))
            t = {s: statistics.median(v) for s, v in times.items()}
            flops = 2 * args.tokens * fan_in * fan_out
            rate = {s: flops / v / 1e9 for s, v in t.items()}
            for s in seconds:
                seconds[s] += count * t[s]
            ratio = min(t["xla"], t["xla-no-ynn"]) / t["torch"]
            print(f"  {weight:8s} {form:9s} {rate['xla']:7.0f} {rate['xla-no-ynn']:7.0f} "
                  f"{rate['torch']:7.0f} {ratio:15.2f}x")
            rows.append({"weight": weight, "form": form, "gflops": rate})
    total = {s: round(v * 1e3, 2) for s, v in seconds.items()}
    print(f"  one layer's 21 products (q, k, v, o, gate, up, down; each form): xla "
          f"{total['xla']} ms, without YNNPACK {total['xla-no-ynn']} ms, PyTorch "
          f"{total['torch']} ms")
    print(json.dumps({"tokens": args.tokens, "layer_ms": total, "products": rows}))


if __name__ == "__main__":
    main()
