"""Pipeline schedules: train-step time of gpipe, circular and 1f1b on the same model and batch.

Each schedule's loss and gradients are compiled for the same mesh (`--stages` simulated CPU
devices by default, or the real ones), the same model, batch and remat policy, and timed
(best of `--repeat` after a warm-up call); the script prints each one's time and its ratio to
gpipe. On CPU the simulated devices share the cores, so a step's time is its total work: the
ratios show the schedules' work (bubbles and recomputation included), not overlap.

    jaxrl bench pipeline_step [--stages 4] [--microbatches 4] [--remat full]
    (or: .venv/bin/python bench/pipeline_step.py ...)
"""

from __future__ import annotations

import argparse
import os
import time

# Eight simulated CPU devices unless told otherwise: enough for up to 8 stages.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxrl.models import ModelConfig, Transformer, abstract_model, param_axes  # noqa: E402
from jaxrl.models.transformer import split_params  # noqa: E402
from jaxrl.train.step import loss_and_grads  # noqa: E402
from sharding import mesh as shd  # noqa: E402
from sharding.pipeline import PipelineConfig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--stages", type=int, default=4, help="pipeline stages (devices)")
    parser.add_argument("--microbatches", type=int, default=4, help="pipeline microbatches")
    parser.add_argument("--layers", type=int, default=8, help="transformer layers")
    parser.add_argument("--width", type=int, default=256, help="embedding width")
    parser.add_argument("--batch", type=int, default=32, help="sequences per step")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--remat", default="full", help="train.remat for every schedule")
    parser.add_argument("--repeat", type=int, default=5, help="timed calls; the best is kept")
    args = parser.parse_args()

    cfg = ModelConfig(vocab_size=256, embed_dim=args.width, num_layers=args.layers,
                      num_heads=8, num_kv_heads=4, head_dim=args.width // 8,
                      mlp_dim=4 * args.width, max_seq_len=args.seq)
    graphdef, params = split_params(Transformer(cfg, rngs=nnx.Rngs(0)))
    ids = np.random.default_rng(0).integers(0, 256, (1, args.batch, args.seq)).astype(np.int32)
    batch = {"input_ids": ids, "targets": np.roll(ids, -1, -1),
             "loss_mask": np.ones(ids.shape, np.float32)}
    mesh = shd.make_mesh(shd.MeshConfig(stage=args.stages, fsdp=1),
                         jax.devices()[:args.stages])
    _, abstract = split_params(abstract_model(cfg))
    param_sh = shd.tree_shardings(param_axes(cfg), abstract, mesh)
    params = jax.device_put(params, param_sh)

    print(f"{args.stages} stages x {args.microbatches} microbatches, {args.layers} layers of "
          f"{args.width}, {args.batch} x {args.seq} tokens, remat={args.remat}, "
          f"{jax.devices()[0].platform}")
    print("| schedule | bubble | step ms | x gpipe |")
    print("|---|---:|---:|---:|")
    base = None
    for schedule, repeats in (("gpipe", 1), ("circular", 2), ("1f1b", 1)):
        pipe = PipelineConfig(stages=args.stages, microbatches=args.microbatches,
                              repeats=repeats, schedule=schedule)
        if args.layers % (args.stages * repeats):
            continue
        step = jax.jit(lambda p, b, pipe=pipe: loss_and_grads(
            graphdef, p, b, remat=args.remat, pipeline=pipe, mesh=mesh)[:2],
            in_shardings=(param_sh, shd.batch_sharding(mesh, 3, leading=1)))
        jax.block_until_ready(step(params, batch))
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            jax.block_until_ready(step(params, batch))
            times.append(time.perf_counter() - start)
        best = min(times)
        base = base or best
        name = schedule if repeats == 1 else f"{schedule}, {repeats} repeats"
        print(f"| {name} | {pipe.bubble_fraction():.1%} | {best * 1e3:.0f} | "
              f"{best / base:.2f} |")


if __name__ == "__main__":
    main()
