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

The table schedules (1f1b, interleaved, zb-h1, v-half, v-min, v-zb) are not lock-step: each
stage runs its own row of a schedule table (`sharding/schedules.py`, `sharding/stage_programs.py`).

Layer l of L belongs to block l // (L/(p*v)); block r*p + s is repeat r of stage s.
Shape letters: P stages, V repeats, M microbatches, b rows per microbatch, T length, D embed.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Literal

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sharding import schedules as sch
from sharding.helix import HelixPlan
from sharding.split_backward import SPLITS

SCHEDULES = ("gpipe", "circular", *sch.TABLE_SCHEDULES, "helix")


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """`sharding.pipeline`: pipeline parallelism over the layer stack; off when stages is 1."""

    stages: int = 1            # p: pipeline stages; the mesh's `stage` axis has this size
    microbatches: int = 4      # m: microbatches the global batch is split into
    repeats: int = 1           # v: blocks of layers per stage (circular, interleaved; the V
    #                            schedules always place 2)
    schedule: Literal["gpipe", "circular", "1f1b", "interleaved", "zb-h1", "v-half", "v-min",
                      "v-zb", "helix"] = "gpipe"
    # PipeOffload: keep only each stage's input, in pinned host memory, for the backward pass
    # and recompute the stage's layers from it (gpipe and circular).
    offload_stage_inputs: bool = False
    # How a schedule that splits the backward into B and W (zb-h1 and the V schedules) splits
    # it: `stash` (B hands W each weight product's operands; B + W costs the fused backward,
    # the stash holds ~21 layer inputs per pending W) or `recompute` (W recomputes the layer
    # from its input; ~1.5x the work, one layer input of stash). sharding/split_backward.py.
    split_backward: Literal["stash", "recompute"] = "stash"
    # HelixPipe (sharding/helix.py): microbatches per attention offset in a wave; a wave is
    # stages x folds microbatches, and microbatches must be a multiple of it.
    folds: int = 2

    def __post_init__(self):
        for name in ("stages", "microbatches", "repeats", "folds"):
            if getattr(self, name) < 1:
                raise ValueError(f"sharding.pipeline.{name}={getattr(self, name)} must be >= 1")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"sharding.pipeline.schedule={self.schedule!r} is not a schedule; "
                             f"choose one of {', '.join(SCHEDULES)}")
        if self.schedule in sch.V_SCHEDULES and self.repeats not in (1, 2):
            raise ValueError(f"sharding.pipeline.schedule={self.schedule} places exactly 2 layer "
                             f"chunks per stage (a V), not repeats={self.repeats}")
        if self.schedule == "interleaved" and (self.repeats < 2
                                               or self.microbatches % self.stages):
            raise ValueError(
                f"sharding.pipeline.schedule=interleaved needs repeats >= 2 and microbatches a "
                f"multiple of stages: repeats={self.repeats}, microbatches={self.microbatches}, "
                f"stages={self.stages}")
        if self.schedule == "helix" and self.microbatches % (self.stages * self.folds):
            raise ValueError(f"sharding.pipeline.schedule=helix sends microbatches in waves of "
                             f"stages x folds = {self.stages} x {self.folds}: microbatches="
                             f"{self.microbatches} is not a multiple of "
                             f"{self.stages * self.folds}")
        if self.repeats > 1 and self.schedule not in ("circular", "interleaved",
                                                      *sch.V_SCHEDULES):
            raise ValueError(f"sharding.pipeline.repeats={self.repeats} needs schedule=circular "
                             f"or interleaved ({self.schedule} runs each stage's layers once "
                             f"per microbatch)")
        if self.schedule == "circular" and self.repeats > 1 and self.microbatches < self.stages:
            raise ValueError(
                f"a circular pipeline needs sharding.pipeline.microbatches >= stages: "
                f"microbatches={self.microbatches} < stages={self.stages} (a microbatch comes "
                f"back to stage 0 after p iterations and must find it free)")
        if self.split_backward not in SPLITS:
            raise ValueError(f"sharding.pipeline.split_backward={self.split_backward!r} is not "
                             f"one of {', '.join(SPLITS)}")
        if self.split_backward != "stash" and self.schedule not in sch.SPLIT_SCHEDULES:
            raise ValueError(f"sharding.pipeline.split_backward={self.split_backward} applies "
                             f"to the schedules that split the backward into B and W "
                             f"({', '.join(sch.SPLIT_SCHEDULES)}), not {self.schedule}")
        if self.offload_stage_inputs and self.schedule not in ("gpipe", "circular"):
            raise ValueError(f"sharding.pipeline.offload_stage_inputs=true works with schedule "
                             f"gpipe or circular, not {self.schedule} (a table schedule keeps "
                             f"only its in-flight microbatches' activations)")

    @property
    def enabled(self) -> bool:
        return self.stages > 1

    @property
    def chunks_per_stage(self) -> int:
        """Blocks of layers each stage holds: 2 for a V schedule, else `repeats`."""
        return 2 if self.schedule in sch.V_SCHEDULES else self.repeats

    @functools.cached_property
    def table(self) -> sch.Schedule | None:
        """The schedule table of a per-stage schedule (None for gpipe and circular)."""
        if self.schedule not in sch.TABLE_SCHEDULES:
            return None
        return sch.build(self.schedule, self.stages, self.microbatches, self.repeats)

    @functools.cached_property
    def reference_table(self) -> sch.Schedule | None:
        """`table` with the frozen reference model's forward filled into its idle ticks
        (PipeFill: the KL term's reference log-probs, `schedules.with_reference`)."""
        return None if self.table is None else sch.with_reference(self.table)

    def check(self, num_layers: int, rows: int, rows_name: str) -> None:
        """ValueError unless the stages and repeats divide `num_layers` and the microbatches
        divide the `rows` of a global batch (called `rows_name` in the message)."""
        blocks = self.stages * self.chunks_per_stage
        if num_layers % blocks:
            what = (f"{self.schedule}'s 2 chunks per stage" if self.schedule in sch.V_SCHEDULES
                    else f"repeats={self.repeats}")
            raise ValueError(
                f"sharding.pipeline.stages={self.stages} x {what} = {blocks} "
                f"blocks do not divide model.num_layers={num_layers}")
        if rows % self.microbatches:
            raise ValueError(f"sharding.pipeline.microbatches={self.microbatches} does not "
                             f"divide {rows_name}={rows}")

    def helix(self, num_layers: int) -> HelixPlan:
        """HelixPipe's plan for a model of `num_layers` layers."""
        return HelixPlan(self.stages, num_layers, self.microbatches, self.folds)

    def bubble_fraction(self, num_layers: int | None = None) -> float:
        """Share of stage-ticks that are idle in this schedule (a table schedule's from its
        table, F = B = W = 1; helix's from its plan with every part of a layer costing the
        same, which needs `num_layers`)."""
        if self.schedule == "helix":
            return self.helix(num_layers).bubble()
        if self.schedule in sch.TABLE_SCHEDULES:
            return self.table.bubble()
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


def pipelined_stack(cfg: PipelineConfig, stack_fn: Callable, mesh: Mesh | None = None,
                    pipeline_order: bool = False):
    """A model `stack_fn` (jaxrl.models.transformer.run_layers's signature) that runs the layer
    stack as a gpipe or circular pipeline; `stack_fn` runs one block's layers (it carries the
    remat policy). `pipeline_order`: the stack is stored in pipeline order
    (sharding/layer_order.py), so laying it out on the stages is a reshape."""

    def stack(model_cfg, stacked, x_BTD, positions_BT, segment_ids_BT=None):
        m = cfg.microbatches

        def block(w, x_bTD, aux):
            return stack_fn(model_cfg, w, x_bTD, *aux)

        aux = (to_microbatches(positions_BT, m),
               None if segment_ids_BT is None else to_microbatches(segment_ids_BT, m))
        w_PV = (jax.tree.map(lambda a: a.reshape(cfg.stages, cfg.repeats, -1, *a.shape[1:]),
                             stacked) if pipeline_order
                else to_stages(stacked, cfg.stages, cfg.repeats))
        out = pipeline_forward(cfg, block, w_PV,
                               to_microbatches(x_BTD, m), aux, mesh)
        return from_microbatches(out)

    return stack
