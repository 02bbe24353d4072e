"""LoRA in the engine: decoding with the adapters' low-rank products against decoding merged
weights, and what a merge costs, side by side.

The engine can serve a LoRA model two ways after each weight update: run every projection's
adapter product per token (`W x + s B(A x)`, no work at the update), or fold the adapters into
the base once per update (`W + s A B`, then plain decoding). This script times, on one device,
with the same random weights: a decode step of each (the same slots, held length and sampler)
and the merge itself, and prints the number of decode steps per update above which merging
costs less. The defaults are Qwen2.5-1.5B's shape in bfloat16 with rank-16 adapters on every
projection.

    jaxrl bench lora_decode [--slots 8] [--held 64] [--steps 4] [--rank 16] [--layers 28]
    (or: .venv/bin/python bench/lora_decode.py ...)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl.models import ModelConfig, abstract_model, lora, split_params  # noqa: E402
from jaxrl.models.lora import LoraConfig  # noqa: E402
from jaxrl.models.peft_io import merged  # noqa: E402
from serving.runner.engine import Engine, EngineConfig, SlotBatch  # noqa: E402
from serving.runner.sampling import SamplingParams  # noqa: E402


def _random_params(cfg: ModelConfig, seed: int) -> dict:
    """Random weights of `cfg`'s shapes, B included (a trained adapter is not zero)."""
    _, abstract = split_params(abstract_model(cfg))
    leaves, tree = jax.tree.flatten(abstract)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [(0.02 * jax.random.normal(k, a.shape)).astype(a.dtype)
                                     for k, a in zip(keys, leaves)])


def _decode_step(cfg: ModelConfig, params, args) -> float:
    """Seconds per decode step of an engine serving `params`, best of `args.repeats`."""
    s, k = args.slots, args.steps
    sizes = EngineConfig(max_concurrent_decodes=s, max_len=args.held + 2 * k,
                         max_prefill_length=8, prefill_chunk=8)
    width = sizes.table_width(args.held + k)
    engine = Engine(cfg, dataclasses.replace(
        sizes, num_pages=max(s * width, sizes.pages_per_sequence) + 1))
    placed = engine.prepare_params(params)
    greedy = [SamplingParams(temperature=0.0)] * s
    table = 1 + np.arange(s * width, dtype=np.int32).reshape(s, width)
    best = float("inf")
    for _ in range(args.repeats + 1):       # the first compiles
        state = engine.init_decode_state()
        state = jax.block_until_ready(engine.insert(state, SlotBatch(
            list(range(s)), [args.held] * s, [3] * s, [1] * s, greedy, [0] * s)))
        t0 = time.perf_counter()
        state, tokens, _ = engine.generate_steps(placed, state, table, k)
        jax.block_until_ready(tokens)
        best = min(best, (time.perf_counter() - t0) / k)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--held", type=int, default=64, help="tokens each slot holds")
    ap.add_argument("--steps", type=int, default=4, help="decode steps per timed call")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    base = ModelConfig(family="qwen2", vocab_size=151936, embed_dim=1536, num_layers=args.layers,
                       num_heads=12, num_kv_heads=2, head_dim=128, mlp_dim=8960,
                       max_seq_len=4096, qkv_bias=True, tie_embeddings=True, dtype="bfloat16",
                       param_dtype="bfloat16")
    adapted = dataclasses.replace(base, lora=LoraConfig(rank=args.rank, alpha=2 * args.rank))
    params = _random_params(adapted, 0)
    fold = jax.jit(lambda p: merged(p, adapted))
    jax.block_until_ready(fold(params))
    merge_s = float("inf")
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fold(params))
        merge_s = min(merge_s, time.perf_counter() - t0)
    adapter_step = _decode_step(adapted, params, args)
    merged_step = _decode_step(base, lora.frozen(fold(params)), args)
    extra = adapter_step - merged_step
    print(f"| engine | decode step ({args.slots} slots, {args.held} held) | merge per update |")
    print("|---|---:|---:|")
    print(f"| adapter products per token | {adapter_step * 1e3:.1f} ms | 0 |")
    print(f"| adapters merged at each update | {merged_step * 1e3:.1f} ms | "
          f"{merge_s * 1e3:.1f} ms |")
    steps = merge_s / extra if extra > 0 else 0.0
    print(f"merging costs less above {steps:.1f} decode steps per update"
          if extra > 0 else "the adapter products cost nothing measurable: never merge")
    print(json.dumps({"adapter_step_s": adapter_step, "merged_step_s": merged_step,
                      "merge_s": merge_s, "break_even_steps": steps}))


if __name__ == "__main__":
    main()
