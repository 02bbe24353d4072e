"""Pipeline schedules: bubble, activation memory and train-step time of every schedule on the
same model and batch.

First the op costs: one stage's F, B (input gradient), W (weight gradient) and X (both) for
one microbatch, timed on one device as the stage programs run them. Then, per schedule, the
bubble from its table (F = B = W = 1) and with those measured costs, its peak activations
(stage-microbatches, from the table), and the step time: each schedule's loss and gradients are
compiled for the same mesh (`--stages` simulated CPU devices by default, or the real ones),
model, batch and remat policy, and timed (best of `--repeat` after a warm-up call), with the
ratio to gpipe. On CPU the simulated devices share the cores, so a step's time is its total
work: the ratios show the schedules' work (recomputation included), not overlap.

With `--kl`, PipeFill instead: an RL step (policy-gradient loss) with a KL term against a
frozen reference model, whose forward runs as R ops in each table schedule's idle ticks, next
to the same step without the KL term. Per schedule: ticks without and with the R ops, the
share of the R work the bubbles absorbed (table, and with the measured F/B/W/R costs), the
step's modelled change with those costs (stages running in parallel), and the measured step
times (on CPU: total work, so the R work shows in full).

    jaxrl bench pipeline_step [--stages 4] [--microbatches 4] [--remat full] [--kl]
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
from jaxrl.train.objectives import PolicyGradientLoss  # noqa: E402
from jaxrl.train.step import Layout, loss_and_grads  # noqa: E402
from sharding.layer_order import LayerOrder  # noqa: E402
from sharding import mesh as shd  # noqa: E402
from sharding import schedules as sch  # noqa: E402
from sharding.offload import single_layer  # noqa: E402
from sharding.split_backward import make_split  # noqa: E402
from sharding.stage_programs import layer_remat  # noqa: E402
from sharding.pipeline import PipelineConfig  # noqa: E402

SCHEDULES = (("gpipe", 1), ("circular", 2), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1),
             ("v-half", 1), ("v-min", 1), ("v-zb", 1))
# Rows with `sharding.pipeline.split_backward=recompute` (the others stash).
RECOMPUTE = (("zb-h1", 1), ("v-zb", 1))


def best_time(fn, *args, repeat: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return min(times)


def op_costs(cfg, params, rows: int, seq: int, layers: int, remat: str, repeat: int) -> dict:
    """Seconds of one stage's F, B, W, X and R on one microbatch (`layers` layers), run the
    way sharding/stage_programs.py runs them: F a layer scan keeping each layer's input; X
    recomputes each layer from its input; B does too and keeps each layer's stash, from which
    W forms the weight gradients (sharding/split_backward.py); "B (recompute)" and "W
    (recompute)" split it the other way. Also each split's stash over a layer's input."""
    one = single_layer(layer_remat(remat))
    w = jax.tree.map(lambda a: a[:layers], params["layers"])
    x = jax.random.normal(jax.random.key(0), (rows, seq, cfg.embed_dim), jax.numpy.float32)
    aux = (jax.numpy.broadcast_to(jax.numpy.arange(seq), (rows, seq)), None)
    layer = lambda w_l, h: one(cfg, w_l, h, *aux)  # noqa: E731
    layer_a = lambda w_l, h, a: one(cfg, w_l, h, *a)  # noqa: E731
    w0 = jax.tree.map(lambda a: a[0], w)
    fwd = jax.jit(lambda w, x: jax.lax.scan(lambda h, w_l: (layer(w_l, h), h), x, w))
    ref = jax.jit(lambda w, x: jax.lax.scan(lambda h, w_l: (layer(w_l, h), None), x, w)[0])
    _, xs = fwd(w, x)

    def fused(w, xs, g):
        def one_layer(g, w_x):
            dw, dx = jax.vjp(layer, *w_x)[1](g)
            return dx, dw
        return jax.lax.scan(one_layer, g, (w, xs), reverse=True)

    costs = {"F": best_time(fwd, w, x, repeat=repeat),
             "X": best_time(jax.jit(fused), w, xs, x, repeat=repeat),
             "R": best_time(ref, w, x, repeat=repeat)}
    ratios = {}
    for how, suffix in (("stash", ""), ("recompute", " (recompute)")):
        split = make_split(how, layer_a, w0, x, aux)
        b_op = jax.jit(lambda w, xs, g, split=split: jax.lax.scan(
            lambda g, w_x: split.input_grad(*w_x, aux, g), g, (w, xs), reverse=True))
        w_op = jax.jit(lambda w, xs, stash, split=split: jax.lax.scan(
            lambda _, w_x_s: (None, split.weight_grads(*w_x_s[:2], aux, w_x_s[2])), None,
            (w, xs, stash))[1])
        _, stash = b_op(w, xs, x)
        costs["B" + suffix] = best_time(b_op, w, xs, x, repeat=repeat)
        costs["W" + suffix] = best_time(w_op, w, xs, stash, repeat=repeat)
        ratios[how] = split.stash_bytes() / x.nbytes
    return costs, ratios


def table_costs(sched, costs: dict, how: str = "stash") -> dict:
    """The op costs a table's ops take (`how` the table splits the backward): X is measured
    as one op, so a table without the B/W split (which costs X as B + W) gets B = X - W."""
    if how == "recompute":
        costs = {**costs, "B": costs["B (recompute)"], "W": costs["W (recompute)"]}
    return costs if sched.split else {**costs, "B": costs["X"] - costs["W"]}


def buffers_held(sched, stash_ratio: float) -> float:
    """A stage's activation buffers in stage-microbatches (one microbatch's input to each of
    the stage's layers), from the table's slot allocation: the layer inputs kept from F, and
    the stash kept from B to W, which holds `stash_ratio` times a layer's input."""
    slots = sch.as_arrays(sched)["slots"]
    held = slots["res"] + (stash_ratio * slots["w"] if sched.split else 0)
    return held / sched.chunks_per_stage


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
    parser.add_argument("--kl", action="store_true",
                        help="PipeFill: RL steps with and without a KL term, table schedules")
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

    rows = args.batch // args.microbatches
    costs, stash_ratios = op_costs(cfg, params, rows, args.seq, args.layers // args.stages,
                                  args.remat, args.repeat)
    unit = costs["F"]
    print(f"{args.stages} stages x {args.microbatches} microbatches, {args.layers} layers of "
          f"{args.width}, {args.batch} x {args.seq} tokens, remat={args.remat}, "
          f"{jax.devices()[0].platform}")
    print("op costs, one stage, one microbatch: " + ", ".join(
        f"{k} {v * 1e3:.1f} ms ({v / unit:.2f} F)" for k, v in costs.items()))
    print(f"B + W = {(costs['B'] + costs['W']) / costs['X']:.2f} X, "
          f"{(costs['B (recompute)'] + costs['W (recompute)']) / costs['X']:.2f} X when W "
          f"recomputes; a layer's stash (B to W) holds {stash_ratios['stash']:.1f}x its input "
          f"(F to B), {stash_ratios['recompute']:.1f}x when W recomputes")
    if args.kl:
        return pipefill(args, graphdef, params, param_sh, batch, mesh, costs)
    print("| schedule | bubble (table) | bubble (measured costs) | peak activations | "
          "buffers held | step ms | x gpipe |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    base = None
    rows = [(s, r, "stash") for s, r in SCHEDULES] + [(s, r, "recompute") for s, r in RECOMPUTE]
    for schedule, repeats, how in rows:
        pipe = PipelineConfig(stages=args.stages, microbatches=args.microbatches,
                              repeats=repeats, schedule=schedule, split_backward=how)
        if args.layers % (args.stages * pipe.chunks_per_stage):
            continue
        if pipe.table is not None:
            bubble = pipe.table.bubble()
            weighted = sch.weighted_bubble(pipe.table, table_costs(pipe.table, costs, how))
            peak = f"{float(pipe.table.peak()):.2f}"
            held = f"{buffers_held(pipe.table, stash_ratios[how]):.1f}"
        else:
            held = "-"
            bubble = weighted = pipe.bubble_fraction()
            peak = str(args.microbatches * repeats) if schedule == "circular" else \
                str(args.microbatches)
        ordered, placed = in_pipeline_order(pipe, params, param_sh, args.layers)
        step = jax.jit(lambda p, b, pipe=pipe, ordered=ordered: loss_and_grads(
            graphdef, p, b, layout=Layout(mesh, args.remat, pipe, ordered))[:2],
            in_shardings=(param_sh, shd.batch_sharding(mesh, 3, leading=1)))
        best = best_time(step, placed, batch, repeat=args.repeat)
        base = base or best
        name = schedule if repeats == 1 else f"{schedule}, {repeats} repeats"
        name += ", W recomputes" if how == "recompute" else ""
        print(f"| {name} | {bubble:.1%} | {weighted:.1%} | {peak} | {held} | "
              f"{best * 1e3:.0f} | {best / base:.2f} |")


def in_pipeline_order(pipe, params, param_sh, layers):
    """(whether the stack is permuted, the parameters as the trainer keeps them for `pipe`:
    in its layer order, sharding/layer_order.py)."""
    order = LayerOrder.for_pipeline(pipe, layers)
    if order is None:
        return False, params
    return True, jax.device_put(order.to_pipeline(params), param_sh)


def pipefill(args, graphdef, params, param_sh, batch, mesh, costs) -> None:
    """PipeFill's table: each table schedule with and without the KL term's R ops."""
    rng = np.random.default_rng(1)
    shape = batch["input_ids"].shape
    batch = {**batch, "segment_ids": np.ones(shape, np.int32),
             "behaviour_logp": -rng.random(shape).astype(np.float32),
             "advantages": rng.normal(size=shape).astype(np.float32)}
    ref_params = jax.tree.map(lambda a: a * 0.9, params)    # any frozen model of the same shape
    print("| schedule | ticks | ticks with R | absorbed (table) | absorbed (measured costs) | "
          "modelled step change | step ms, no KL | step ms, KL | measured change |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for schedule, repeats in SCHEDULES:
        pipe = PipelineConfig(stages=args.stages, microbatches=args.microbatches,
                              repeats=repeats, schedule=schedule)
        if pipe.table is None or args.layers % (args.stages * pipe.chunks_per_stage):
            continue
        base, filled = pipe.table, pipe.reference_table
        weights = table_costs(base, costs)
        modelled = sch.weighted_makespan(filled, weights) / sch.weighted_makespan(base, weights)
        times = []
        ordered, placed = in_pipeline_order(pipe, params, param_sh, args.layers)
        _, ref_placed = in_pipeline_order(pipe, ref_params, param_sh, args.layers)
        for kl in (0.0, 0.1):
            objective = PolicyGradientLoss(kind="ppo", kl_coef=kl)
            step = jax.jit(lambda p, b, r, pipe=pipe, objective=objective, ordered=ordered:
                           loss_and_grads(graphdef, p, b, objective, r,
                                          Layout(mesh, args.remat, pipe, ordered))[:2],
                           in_shardings=(param_sh, shd.batch_sharding(mesh, 3, leading=1),
                                         None if kl == 0 else param_sh))
            times.append(best_time(step, placed, batch, ref_placed if kl else None,
                                   repeat=args.repeat))
        name = schedule if repeats == 1 else f"{schedule}, {repeats} repeats"
        print(f"| {name} | {base.ticks} | {filled.ticks} | {sch.absorbed(base, filled):.0%} | "
              f"{sch.absorbed(base, filled, weights):.0%} | {modelled - 1:+.1%} | "
              f"{times[0] * 1e3:.0f} | {times[1] * 1e3:.0f} | {times[1] / times[0] - 1:+.1%} |")


if __name__ == "__main__":
    main()
