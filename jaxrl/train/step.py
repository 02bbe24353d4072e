"""The jitted, sharded train step: masked token loss, gradient accumulation, AdamW.

A train state is a plain dict `{params, opt_state, step, rng}` of arrays, placed on the mesh by
`init_state` / `state_shardings` and updated in place (donated) by the step.

Batches are dicts of `[M, B/M, T]` arrays (M microbatches): `input_ids`, `targets` and
`loss_mask` (1.0 where the target token counts). The loss is the mean over all counted tokens of
the whole global batch, so the accumulated gradient equals the one-shot gradient exactly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

from typing import Callable

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import optax
from jax.sharding import Mesh

from jaxrl.models import lora, merge_params
from jaxrl.train import helix_step
from jaxrl.train.objectives import SupervisedLoss
from jaxrl.train.pipeline_io import pipeline_io
from jaxrl.train.state import optimizer_on_device, trained
from sharding import context as context_parallel
from sharding import mesh as shd
from sharding import pipeline as pp
from sharding import stage_programs
from sharding.offload import layer_stack, single_layer


def _combine(name: str, a, b):
    if name.endswith("_min"):
        return jnp.minimum(a, b)
    if name.endswith("_max"):
        return jnp.maximum(a, b)
    return a + b


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a train step's layers run and what they keep: the `mesh` (None: the default
    device), `remat` (what each layer keeps for its backward: none, full, offload, ...), a
    `pipeline` over the mesh's stage axis, and `pipeline_order` (the state's layer stacks are
    in the pipeline's order: sharding/layer_order.py)."""

    mesh: Mesh | None = None
    remat: str = "none"
    pipeline: pp.PipelineConfig | None = None
    pipeline_order: bool = False

    @property
    def pipelined(self) -> bool:
        return self.pipeline is not None and self.pipeline.enabled

    def stage_mesh(self) -> Mesh:
        """The mesh, or one of the first `stages` devices along a stage axis."""
        stages = self.pipeline.stages
        return self.mesh or shd.make_mesh(shd.MeshConfig(stage=stages), jax.devices()[:stages])


def loss_and_grads(graphdef, params, batch, objective=SupervisedLoss(), ref_params=None,
                   layout: Layout = Layout(), dropout_key=None):
    """sum(loss_sum) / sum(weight) over the microbatches of `batch` ([M, ...] arrays), its
    gradient (accumulated in float32) and the objective's metrics.

    Without a pipeline the microbatches are a gradient-accumulation scan, and a microbatch with
    nothing to learn from (loss_mask all zero, e.g. padding of a packed RL step) is skipped.
    With one (`layout.pipeline.stages > 1`) the whole batch goes through the pipeline schedule,
    split into `pipeline.microbatches`. With `layout.pipeline_order` the layer stacks of
    `params` and `ref_params` are in the pipeline's order, and so is the gradient's.
    `dropout_key`: model.lora.dropout's randomness for this step (no pipeline runs LoRA)."""
    ref_model = None if ref_params is None else merge_params(graphdef, ref_params)
    stack = layer_stack(layout.remat)
    if layout.pipelined:
        pipeline = layout.pipeline
        flat = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), batch)
        if pipeline.schedule == "helix":
            loss, weight, stats, grads = _helix_grads(graphdef, params, flat, objective,
                                                      ref_params, layout)
        elif pipeline.table is not None:
            loss, weight, stats, grads = _scheduled_grads(graphdef, params, flat, objective,
                                                          ref_params, layout)
        else:
            _check_nested_offload(layout)
            stack = pp.pipelined_stack(pipeline, stack, layout.mesh, layout.pipeline_order)

            adapters_only = merge_params(graphdef, params).cfg.lora.enabled

            def batch_loss(t):
                p = lora.with_trainable(params, t) if adapters_only else t
                loss_sum, weight, stats = objective(merge_params(graphdef, p), flat, ref_model,
                                                    stack)
                return loss_sum, (weight, stats)

            (loss, (weight, stats)), grads = jax.value_and_grad(batch_loss, has_aux=True)(
                optimized(graphdef, params))
    else:
        loss, weight, stats, grads = _accumulated_grads(graphdef, params, batch, objective,
                                                        ref_model, stack, dropout_key)
    weight = jnp.maximum(weight, 1.0)
    grads = jax.tree.map(lambda g, p: (g / weight).astype(p.dtype), grads,
                         optimized(graphdef, params))
    return loss / weight, grads, objective.summarize(stats)


def optimized(graphdef, params):
    """What the optimizer updates: the LoRA adapters when the model has them (the base is
    frozen: no gradient, no optimizer state), else every parameter."""
    return trained(merge_params(graphdef, params).cfg, params)


def _check_nested_offload(layout: Layout) -> None:
    """Per-layer host offload nested in a gpipe/circular pipeline's scan trips an XLA error on
    TPU (the host residuals stacked by the outer scan get a layout without the host memory
    space); it compiles on CPU. Say so, and what works, before XLA does."""
    mesh, pipeline = layout.mesh, layout.pipeline
    if (layout.remat == "offload" and mesh is not None
            and mesh.devices.flat[0].platform == "tpu"):
        raise ValueError(
            f"train.remat=offload inside a {pipeline.schedule} pipeline (sharding.pipeline."
            f"stages={pipeline.stages}) does not compile for TPU: XLA rejects host-offloaded "
            f"layer activations stacked by the pipeline's scan. Use sharding.pipeline."
            f"offload_stage_inputs=true (PipeOffload: each stage's input on host) or "
            f"sharding.pipeline.schedule=1f1b (which runs train.remat=offload inside each "
            f"stage's backward)")


def _accumulated_grads(graphdef, params, batch, objective, ref_model, stack, dropout_key):
    """(sum of loss_sum, sum of weight, combined stats, float32 gradient of the loss sum),
    accumulated over the microbatches of `batch` by a scan; each microbatch's LoRA dropout
    drawn from `dropout_key` and its index."""

    adapters_only = merge_params(graphdef, params).cfg.lora.enabled

    def mb_loss(p, mb, i):
        p = lora.with_trainable(params, p) if adapters_only else p
        run = stack if dropout_key is None else \
            lora.dropout_stack(stack, jax.random.fold_in(dropout_key, i))
        loss_sum, weight, stats = objective(merge_params(graphdef, p), mb, ref_model, run)
        return loss_sum, (weight, stats)

    grad_fn = jax.value_and_grad(mb_loss, has_aux=True)
    train = optimized(graphdef, params)
    (loss0, (weight0, stats0)), grads0 = jax.eval_shape(
        grad_fn, train, jax.tree.map(lambda x: x[0], batch), 0)
    identity = {k: jnp.full(v.shape, jnp.inf if k.endswith("_min") else
                            -jnp.inf if k.endswith("_max") else 0.0, v.dtype)
                for k, v in stats0.items()}
    nothing = ((jnp.zeros(loss0.shape, loss0.dtype), (jnp.zeros(weight0.shape, weight0.dtype),
                                                     identity)),
               jax.tree.map(lambda g: jnp.zeros(g.shape, g.dtype), grads0))

    def accumulate(carry, xs):
        grads, loss, weight, stats = carry
        mb, i = xs
        (mb_loss_sum, (mb_weight, mb_stats)), mb_grads = jax.lax.cond(
            jnp.any(mb["loss_mask"] > 0), lambda: grad_fn(train, mb, i), lambda: nothing)
        grads = jax.tree.map(lambda g, d: g + d.astype(jnp.float32), grads, mb_grads)
        stats = {k: _combine(k, stats[k], v) for k, v in mb_stats.items()}
        return (grads, loss + mb_loss_sum, weight + mb_weight, stats), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), train)
    microbatches = jax.tree.leaves(batch)[0].shape[0]
    (grads, loss, weight, stats), _ = jax.lax.scan(
        accumulate, (zeros, 0.0, 0.0, identity), (batch, jnp.arange(microbatches)))
    return loss, weight, stats, grads


def _scheduled_grads(graphdef, params, batch, objective, ref_params, layout: Layout):
    """The same four values as `_accumulated_grads`, by a per-stage schedule table
    (sharding/stage_programs.py): the embedding runs in the first chunk's forward on its
    stage, each microbatch's when it is due, and its gradient in that chunk's backward; the
    head (final norm, logits, objective) after the last chunk's forward. Microbatches with nothing
    to learn from (RL padding) run no pipeline op. With `ref_params` (the KL term's frozen
    reference model) the table's R ops run the reference model chunk by chunk on the same
    stages, in the ticks the schedule leaves idle (PipeFill), and its head hands each
    microbatch's reference log-probs to the objective. What each layer keeps for its backward
    follows `layout.remat` (sharding/layer_keep.py): its input, the layer recomputed, under
    `full` (no second recompute) and `offload`; its vjp's residuals under `none` and
    `minimal`."""
    pipeline, mesh = layout.pipeline, layout.stage_mesh()
    io = pipeline_io(graphdef, params, batch, objective, pipeline.microbatches)
    sched = pipeline.table if ref_params is None else pipeline.reference_table
    layer_fn = single_layer(stage_programs.layer_remat(layout.remat))

    def layer(w_l, x_bTD, aux):
        return layer_fn(io.model_cfg, w_l, x_bTD, *aux)

    if layout.pipeline_order:
        to_stages, from_stages = (functools.partial(stage_programs.stage_view, sched=sched),
                                  stage_programs.flat_view)
    else:
        to_stages, from_stages = (functools.partial(stage_programs.to_stage_chunks, sched=sched),
                                  functools.partial(stage_programs.from_stage_chunks,
                                                    sched=sched))
    adapters = lora.trainable(params)["layers"] if io.model_cfg.lora.enabled else None
    problem = stage_programs.StageProblem(layer, io.head, io.embed, to_stages(params["layers"]),
                                          io.outer, io.ids_M, io.aux_M, io.batch_M, io.live_M)
    options = stage_programs.ScheduleOptions(
        _reference(graphdef, ref_params, objective, to_stages),
        pipeline.split_backward, _replicate_heads(mesh),
        None if adapters is None else frozenset(adapters), layout.remat)
    loss_M, (weight_M, stats_M), g_w, g_outer = stage_programs.run_schedule(
        sched, problem, mesh, options)
    grads = {"layers": from_stages(g_w)}
    if adapters is None:        # LoRA: the layers' adapters alone are trained
        grads.update(g_outer)
    stats = {k: _reduce_over_microbatches(k, v, io.live_M) for k, v in stats_M.items()}
    return jnp.sum(loss_M), jnp.sum(weight_M), stats, grads


def _helix_grads(graphdef, params, batch, objective, ref_params, layout: Layout):
    """The same four values as `_accumulated_grads`, by HelixPipe (jaxrl/train/helix_step.py)."""
    if ref_params is not None:
        raise ValueError("sharding.pipeline.schedule=helix does not run the KL term's "
                         "reference model; use a table schedule (1f1b, zb-h1 or a V "
                         "schedule, which fill their bubbles with it) or set rl.kl_coef=0")
    mesh = layout.stage_mesh()
    loss_M, weight_M, stats_M, live_M, grads = helix_step.helix_grads(
        graphdef, params, batch, objective, layout.pipeline, mesh, layout.pipeline_order,
        _replicate_heads(mesh))
    stats = {k: _reduce_over_microbatches(k, v, live_M) for k, v in stats_M.items()}
    return jnp.sum(loss_M), jnp.sum(weight_M), stats, grads


def _replicate_heads(mesh: Mesh) -> bool:
    """Whether the heads run on whole copies of their parameters: beside both fsdp and tensor
    XLA's SPMD partitioner aborts (spmd_partitioner_util.cc, "Check failed:
    partition_group_list...") on a head sharded over both inside a stage program's
    `lax.switch` (docs/guides/pipelines-tpu.md)."""
    return mesh.shape.get("fsdp", 1) > 1 and mesh.shape.get("tensor", 1) > 1


def _reference(graphdef, ref_params, objective, to_stages):
    """The frozen reference model as a table's R ops run it, or None without one."""
    if ref_params is None:
        return None
    ref_params = jax.lax.stop_gradient(ref_params)
    ref_outer = {k: v for k, v in ref_params.items() if k != "layers"}

    def ref_head(o, h_bTD, mb):
        model = merge_params(graphdef, {**o, "layers": ref_params["layers"]})
        return objective.reference_logp(model, mb, lambda *_: h_bTD)

    def ref_embed(o, ids_bT):
        return merge_params(graphdef, {**o, "layers": ref_params["layers"]}).embed_tokens(ids_bT)

    return stage_programs.Reference(w_PV=to_stages(ref_params["layers"]),
                                    head_params=ref_outer, head_fn=ref_head,
                                    embed_fn=ref_embed)


def _reduce_over_microbatches(name: str, v_M, live_M):
    """A statistic over the microbatches that ran (min, max or sum by its name)."""
    live = live_M.reshape(-1, *(1,) * (v_M.ndim - 1))
    if name.endswith("_min"):
        return jnp.min(jnp.where(live, v_M, jnp.inf), axis=0)
    if name.endswith("_max"):
        return jnp.max(jnp.where(live, v_M, -jnp.inf), axis=0)
    return jnp.sum(jnp.where(live, v_M, 0), axis=0)


def make_train_step(graphdef, tx: optax.GradientTransformation, schedule=None,
                    objective=SupervisedLoss(), layout: Layout = Layout(),
                    opt_device=None) -> Callable:
    """`step(state, batch) -> (state, metrics)`, not yet jitted (see `jit_train_step`). A state
    with `ref_params` (a frozen reference model) hands them to the objective. `opt_device`:
    device shardings to bring a host-resident optimizer state in for the update (see
    `state_shardings(offload_optimizer=True)`); the step's out_shardings send it back."""
    mesh = layout.mesh

    def step(state, batch):
        if "oldest_version" in batch:   # RL: tokens whose whole context these weights made
            batch = {**batch, "on_policy": ((batch["oldest_version"] == state["step"])
                                            & (batch["loss_mask"] > 0)).astype(jnp.float32)}
        # Splash attention, expert and context parallelism run in shard_map over the mesh
        # they find in this context.
        cfg = merge_params(graphdef, state["params"]).cfg
        context = (jax.sharding.use_abstract_mesh(mesh.abstract_mesh) if mesh is not None
                   and (cfg.attention == "splash" or cfg.num_experts
                        and mesh.shape.get("expert", 1) > 1 or mesh.shape.get("context", 1) > 1)
                   else contextlib.nullcontext())
        if mesh is not None:
            batch = context_parallel.to_context_order(batch, mesh)
        dropout = (jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
                   if cfg.lora.enabled and cfg.lora.dropout else None)
        with context:
            loss, grads, aux = loss_and_grads(graphdef, state["params"], batch, objective,
                                              state.get("ref_params"), layout, dropout)
        opt_state = state["opt_state"]
        if opt_device is not None:
            opt_state = jax.device_put(opt_state, opt_device)
        train = optimized(graphdef, state["params"])
        updates, opt_state = tx.update(grads, opt_state, train)
        params = optax.apply_updates(train, updates)
        if cfg.lora.enabled:
            params = lora.with_trainable(state["params"], params)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), **aux}
        if schedule is not None:
            metrics["lr"] = schedule(state["step"])
        return {**state, "params": params, "opt_state": opt_state,
                "step": state["step"] + 1}, metrics

    return step


# Models at least this wide train faster on XLA:CPU outside its YNNPACK fusions (below).
PLAIN_DOT_WIDTH = 256


def compiler_options(mesh: Mesh, width: int) -> dict[str, str] | None:
    """XLA options for the train step of a model `width` wide on this mesh's platform. On
    XLA:CPU (jaxlib 0.10, where it was measured) the step's float32 matmuls run 14-15% faster
    outside XLA's YNNPACK fusions once they are wide: a step of the 30M peer job (576 wide)
    14.7 -> 12.7 s, of the 3M one (256 wide) at 529 tokens 29.4 -> 25.0 s, at 81 tokens the
    same (docs/benchmarks.md). Narrower models lose: YNNPACK's fused element-wise work counts
    for more there (the long-tail test's run, 64 wide: 33.9 -> 37.4 s). The engine's decode
    programs keep the fusions (faster with them at every width measured)."""
    if (mesh.devices.flat[0].platform != "cpu" or not jaxlib.__version__.startswith("0.10.")
            or width < PLAIN_DOT_WIDTH):
        return None
    return {"xla_cpu_experimental_ynn_fusion_type": ""}


def jit_train_step(graphdef, tx, shardings, layout: Layout, schedule=None,
                   objective=SupervisedLoss(), rules=shd.RULES, width: int = 0):
    """The train step compiled for `layout.mesh`; the state is donated and updated in place.
    `width`, the model's embedding width, picks XLA:CPU's options (`compiler_options`)."""
    mesh = layout.mesh
    batch = shd.batch_sharding(mesh, 3, rules, leading=1)
    return jax.jit(make_train_step(graphdef, tx, schedule, objective, layout,
                                   opt_device=optimizer_on_device(shardings)),
                   in_shardings=(shardings, batch),
                   out_shardings=(shardings, shd.replicated(mesh)),
                   donate_argnums=0, compiler_options=compiler_options(mesh, width))


def split_microbatches(batch: dict[str, np.ndarray], microbatches: int) -> dict:
    """[B, T] host arrays -> [M, B/M, T]."""
    return {k: v.reshape(microbatches, v.shape[0] // microbatches, *v.shape[1:])
            for k, v in batch.items()}
