"""Pipeline parallelism: the layer stack split into stages over the `stage` mesh axis.

SPMD pipelining, as in MaxText and praxis: one program runs on every device, a `lax.scan` walks
the schedule's iterations, and every iteration all p stages compute at once (a `vmap` over the
stage dimension of arrays sharded over `stage`). Activations move to the next stage by a roll of
that dimension, which XLA lowers to a collective permute. The `fsdp` and `tensor` axes shard the
other dimensions as usual, inside each stage.

Schedules, for p stages, m microbatches and v repeats:
- gpipe:    every microbatch through every stage, then the backward pass (autodiff of the scan).
            A stage keeps the activations of all m microbatches. Bubble (p-1)/(m+p-1).
- circular: v blocks of layers per stage; stage s holds blocks s, s+p, ..., s+(v-1)p and a
            microbatch loops through the stages v times (MaxText's circular pipeline, Megatron's
            interleaved placement). Bubble (p-1)/(v*m+p-1); needs m >= p when v > 1.
- 1f1b:     forward and backward interleaved by hand with per-stage `jax.vjp` calls: every
            iteration each stage runs one forward and one backward, so a stage holds the inputs
            of at most 2p-1 microbatches instead of m (PipeDream-Flush's one-forward-one-backward,
            in lock-step SPMD form); the backward recomputes the stage's forward from its input.
            Of the m+2p-2 iterations, the first p-1 run only forwards and the last p-1 only
            backwards, so the bubble is GPipe's, (p-1)/(m+p-1).

Layer l of L belongs to block l // (L/(p*v)); block r*p + s is repeat r of stage s.
Shape letters: P stages, V repeats, M microbatches, b rows per microbatch, T length, D embed.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Literal

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

SCHEDULES = ("gpipe", "circular", "1f1b")


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """`sharding.pipeline`: pipeline parallelism over the layer stack; off when stages is 1."""

    stages: int = 1            # p: pipeline stages; the mesh's `stage` axis has this size
    microbatches: int = 4      # m: microbatches the global batch is split into
    repeats: int = 1           # v: blocks of layers per stage (circular only)
    schedule: Literal["gpipe", "circular", "1f1b"] = "gpipe"
    # PipeOffload: keep only each stage's input, in pinned host memory, for the backward pass
    # and recompute the stage's layers from it (gpipe and circular).
    offload_stage_inputs: bool = False

    def __post_init__(self):
        for name in ("stages", "microbatches", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"sharding.pipeline.{name}={getattr(self, name)} must be >= 1")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"sharding.pipeline.schedule={self.schedule!r} is not a schedule; "
                             f"choose one of {', '.join(SCHEDULES)}")
        if self.repeats > 1 and self.schedule != "circular":
            raise ValueError(f"sharding.pipeline.repeats={self.repeats} needs schedule=circular "
                             f"({self.schedule} runs each stage's layers once per microbatch)")
        if self.schedule == "circular" and self.repeats > 1 and self.microbatches < self.stages:
            raise ValueError(
                f"a circular pipeline needs sharding.pipeline.microbatches >= stages: "
                f"microbatches={self.microbatches} < stages={self.stages} (a microbatch comes "
                f"back to stage 0 after p iterations and must find it free)")
        if self.offload_stage_inputs and self.schedule == "1f1b":
            raise ValueError("sharding.pipeline.offload_stage_inputs=true works with schedule "
                             "gpipe or circular, not 1f1b (1f1b already keeps at most 2p-1 "
                             "stage inputs)")

    @property
    def enabled(self) -> bool:
        return self.stages > 1

    def check(self, num_layers: int, rows: int, rows_name: str) -> None:
        """ValueError unless the stages and repeats divide `num_layers` and the microbatches
        divide the `rows` of a global batch (called `rows_name` in the message)."""
        blocks = self.stages * self.repeats
        if num_layers % blocks:
            raise ValueError(
                f"sharding.pipeline.stages={self.stages} x repeats={self.repeats} = {blocks} "
                f"blocks do not divide model.num_layers={num_layers}")
        if rows % self.microbatches:
            raise ValueError(f"sharding.pipeline.microbatches={self.microbatches} does not "
                             f"divide {rows_name}={rows}")

    def bubble_fraction(self) -> float:
        """Share of stage-iterations that are idle (compute on nothing) in this schedule."""
        p, m, v = self.stages, self.microbatches, self.repeats
        return (p - 1) / (v * m + p - 1)


# Layout helpers ------------------------------------------------------------------------------

def to_stages(stacked: dict, stages: int, repeats: int) -> dict:
    """[L, ...] layer parameters -> [P, V, L/(P*V), ...]: stage s, repeat r holds block r*P+s."""
    def split(a):
        a = a.reshape(repeats, stages, a.shape[0] // (stages * repeats), *a.shape[1:])
        return jnp.swapaxes(a, 0, 1)
    return jax.tree.map(split, stacked)


def from_stages(g_PV: dict) -> dict:
    """Inverse of `to_stages`: [P, V, L/(P*V), ...] -> [L, ...]."""
    def merge(a):
        a = jnp.swapaxes(a, 0, 1)
        return a.reshape(a.shape[0] * a.shape[1] * a.shape[2], *a.shape[3:])
    return jax.tree.map(merge, g_PV)


def to_microbatches(a, m: int):
    """[B, ...] -> [M, B/M, ...]: microbatch j holds rows j, j+M, j+2M, ... so that a batch
    sharded in contiguous blocks over the data axes stays sharded the same way inside each
    microbatch."""
    return jnp.swapaxes(a.reshape(a.shape[0] // m, m, *a.shape[1:]), 0, 1)


def from_microbatches(a):
    """Inverse of `to_microbatches`."""
    return jnp.swapaxes(a, 0, 1).reshape(-1, *a.shape[2:])


def _on_stages(x, mesh: Mesh | None, dim: int = 0):
    """Pins dimension `dim` of x to the `stage` mesh axis (the rest left to XLA)."""
    if mesh is None or mesh.shape.get("stage", 1) == 1:
        return x
    spec = [P.UNCONSTRAINED] * x.ndim
    spec[dim] = "stage"
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))


def _take(tree, index):
    """tree[index] along the leading axis, index an int array (possibly one per stage)."""
    return jax.tree.map(lambda a: a[index], tree)


def _offload_input(block_fn: Callable) -> Callable:
    """`block_fn` that keeps only its input, in pinned host memory, for the backward pass."""
    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=("stage_input",),
        offload_src="device", offload_dst="pinned_host")

    def block(w, x, aux):
        return block_fn(w, checkpoint_name(x, "stage_input"), aux)
    return jax.checkpoint(block, policy=policy)


# GPipe and circular: a forward scan, differentiated by JAX ----------------------------------

def pipeline_forward(cfg: PipelineConfig, block_fn: Callable, w_PV, x_MbTD, aux_M,
                     mesh: Mesh | None = None):
    """Runs every microbatch through all P*V blocks. `block_fn(w, x_bTD, aux_b) -> x_bTD` runs
    one block (w: its layers, [L/(P*V), ...]); `w_PV` from `to_stages`; `aux_M` a tree of
    per-microbatch inputs ([M, b, ...]: positions, segment ids). Returns the last block's output
    for every microbatch, [M, b, T, D]."""
    p, v, m = cfg.stages, cfg.repeats, x_MbTD.shape[0]
    if cfg.offload_stage_inputs:
        block_fn = _offload_input(block_fn)
    run = jax.vmap(block_fn)
    stage = jnp.arange(p)
    w_PV = jax.tree.map(lambda a: _on_stages(a, mesh), w_PV)

    def iteration(carry, i):
        x_PbTD, out_MbTD = carry
        item = i - stage                      # stage s works on item i - s: repeat r, microbatch j
        r, j = jnp.clip(item // m, 0, v - 1), item % m
        # Stage 0 takes a fresh microbatch during the first repeat, then what the last stage
        # left in `out` one repeat earlier.
        first = jnp.where(i < m, x_MbTD[i % m], out_MbTD[i % m])
        x_PbTD = _on_stages(x_PbTD.at[0].set(first), mesh)
        w = jax.tree.map(lambda a: jax.vmap(lambda a_s, r_s: a_s[r_s])(a, r), w_PV)
        y_PbTD = run(w, x_PbTD, _take(aux_M, j))
        done = i - (p - 1)                    # the item the last stage just finished
        slot = done % m
        out_MbTD = out_MbTD.at[slot].set(jnp.where(done >= 0, y_PbTD[-1], out_MbTD[slot]))
        return (jnp.roll(y_PbTD, 1, axis=0), out_MbTD), None

    state = jnp.zeros((p, *x_MbTD.shape[1:]), x_MbTD.dtype)
    (_, out), _ = jax.lax.scan(iteration, (state, jnp.zeros_like(x_MbTD)),
                               jnp.arange(v * m + p - 1))
    return out


def pipelined_stack(cfg: PipelineConfig, stack_fn: Callable, mesh: Mesh | None = None):
    """A model `stack_fn` (jaxrl.models.transformer.run_layers's signature) that runs the layer
    stack as a gpipe or circular pipeline; `stack_fn` runs one block's layers (it carries the
    remat policy)."""

    def stack(model_cfg, stacked, x_BTD, positions_BT, segment_ids_BT=None):
        m = cfg.microbatches

        def block(w, x_bTD, aux):
            return stack_fn(model_cfg, w, x_bTD, *aux)

        aux = (to_microbatches(positions_BT, m),
               None if segment_ids_BT is None else to_microbatches(segment_ids_BT, m))
        out = pipeline_forward(cfg, block, to_stages(stacked, cfg.stages, cfg.repeats),
                               to_microbatches(x_BTD, m), aux, mesh)
        return from_microbatches(out)

    return stack


# 1F1B: forward and backward interleaved by hand ---------------------------------------------

def one_f_one_b(cfg: PipelineConfig, block_fn: Callable, head_fn: Callable, w_PV, head_params,
                x_MbTD, aux_M, head_in_M, mesh: Mesh | None = None):
    """Loss and gradients of a pipelined model by the 1F1B schedule.

    `block_fn(w, x_bTD, aux_b) -> x_bTD` runs one stage's layers; `head_fn(head_params, h_bTD,
    head_in_b) -> (loss, head_aux)` is everything after the last stage for one microbatch (final
    norm, logits, loss), `loss` a scalar. Returns (loss [M], head_aux [M, ...], gradient of
    sum(loss) w.r.t. w_PV, w.r.t. head_params, and w.r.t. x_MbTD, the pipeline's inputs, for the
    caller to carry into the embedding)."""
    p, m = cfg.stages, x_MbTD.shape[0]
    keep = min(m, 2 * p - 1)                  # stage inputs alive per stage (ring buffer slots)
    stage = jnp.arange(p)
    w_P = jax.tree.map(lambda a: _on_stages(a[:, 0], mesh), w_PV)
    forward = jax.vmap(block_fn)

    def stage_backward(w, x_bTD, aux, g_bTD):
        _, pull = jax.vjp(lambda w_, x_: block_fn(w_, x_, aux), w, x_bTD)
        return pull(g_bTD)

    backward = jax.vmap(stage_backward)

    def head(h_bTD, j):
        head_in = _take(head_in_M, j)
        loss, pull, head_aux = jax.vjp(lambda hp, h: head_fn(hp, h, head_in), head_params,
                                       h_bTD, has_aux=True)
        g_head, g_h = pull(jnp.ones_like(loss))
        return loss, head_aux, g_head, g_h

    shapes = jax.eval_shape(head, x_MbTD[0], 0)

    def no_head(h_bTD, j):
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    def tick(carry, t):
        fwd_PbTD, bwd_PbTD, saved_PKbTD, g_w, g_head, dx_MbTD, loss_M, aux_M_out = carry
        # Forward: stage s runs microbatch t - s; stage 0 takes it from the inputs.
        jf = t - stage
        f_ok, jf = (jf >= 0) & (jf < m), jnp.clip(jf, 0, m - 1)
        x_PbTD = _on_stages(fwd_PbTD.at[0].set(x_MbTD[jf[0]]), mesh)
        saved_PKbTD = jax.vmap(lambda buf, k, ok, x: buf.at[k].set(jnp.where(ok, x, buf[k])))(
            saved_PKbTD, jf % keep, f_ok, x_PbTD)
        # The first p-1 iterations have no backward anywhere and the last p-1 no forward:
        # skip that work outright, so the ramps cost one pass, not two (the bubble is GPipe's).
        y_PbTD = jax.lax.cond(t < m + p - 1,
                              lambda: forward(w_P, x_PbTD, _take(aux_M, jf)),
                              lambda: jnp.zeros_like(x_PbTD))
        # The head on the last stage's output, then its backward, in the same iteration.
        loss, head_aux, gh_params, g_h = jax.lax.cond(f_ok[-1], head, no_head, y_PbTD[-1], jf[-1])
        loss_M = loss_M.at[jf[-1]].set(jnp.where(f_ok[-1], loss, loss_M[jf[-1]]))
        aux_M_out = jax.tree.map(lambda buf, a: buf.at[jf[-1]].set(
            jnp.where(f_ok[-1], a, buf[jf[-1]])), aux_M_out, head_aux)
        g_head = jax.tree.map(lambda acc, g: acc + g.astype(acc.dtype), g_head, gh_params)
        # Backward: stage s runs microbatch t - (2p-2-s), recomputing its forward from the
        # saved input; the cotangent comes from stage s+1 one iteration earlier (the head's, on
        # the last stage).
        jb = t - (2 * p - 2 - stage)
        b_ok, jb = (jb >= 0) & (jb < m), jnp.clip(jb, 0, m - 1)
        x_saved = jax.vmap(lambda buf, k: buf[k])(saved_PKbTD, jb % keep)
        g_in = _on_stages(bwd_PbTD.at[-1].set(g_h), mesh)
        gw_P, gx_PbTD = jax.lax.cond(
            t >= p - 1, lambda: backward(w_P, x_saved, _take(aux_M, jb), g_in),
            lambda: (jax.tree.map(jnp.zeros_like, w_P), jnp.zeros_like(g_in)))
        g_w = jax.tree.map(lambda acc, g: acc + jnp.where(
            b_ok.reshape(p, *(1,) * (g.ndim - 1)), g, 0).astype(acc.dtype), g_w, gw_P)
        dx_MbTD = dx_MbTD.at[jb[0]].set(jnp.where(b_ok[0], gx_PbTD[0], dx_MbTD[jb[0]]))
        return (jnp.roll(y_PbTD, 1, axis=0), jnp.roll(gx_PbTD, -1, axis=0), saved_PKbTD, g_w,
                g_head, dx_MbTD, loss_M, aux_M_out), None

    f32 = lambda a: jnp.zeros(a.shape, jnp.float32)  # noqa: E731
    state = jnp.zeros((p, *x_MbTD.shape[1:]), x_MbTD.dtype)
    init = (state, state, jnp.zeros((p, keep, *x_MbTD.shape[1:]), x_MbTD.dtype),
            jax.tree.map(f32, w_P), jax.tree.map(f32, head_params), jnp.zeros_like(x_MbTD),
            jnp.zeros((m,), shapes[0].dtype),
            jax.tree.map(lambda s: jnp.zeros((m, *s.shape), s.dtype), shapes[1]))
    carry, _ = jax.lax.scan(tick, init, jnp.arange(m + 2 * p - 2))
    _, _, _, g_w, g_head, dx, loss_M, aux_out = carry
    return loss_M, aux_out, jax.tree.map(lambda g: g[:, None], g_w), g_head, dx
