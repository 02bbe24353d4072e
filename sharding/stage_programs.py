"""Per-stage pipeline programs: each stage follows its own row of a schedule table.

A `shard_map` over the mesh's `stage` axis (the fsdp, tensor and data axes stay automatic
inside it) runs one `lax.scan` over the table's ticks. At every tick a stage reads its row
(op, chunk, microbatch, buffer slots) and `lax.switch` runs only that op: F, B, W, X (B and W
together), F of the last chunk with the head, R (the reference model's forward, PipeFill), R of
the last chunk with the reference head, or nothing. Its output (an activation going
forward, a cotangent going back) moves to the neighbour stage by `ppermute`, with the slot the
receiver keeps it in, or stays on the stage (a V's turn, the head's cotangent). Stage s
therefore runs F of microbatch 5 while stage s+1 runs B of microbatch 2: the schedules of
`sharding/schedules.py` run as written, not in lock step. The ops, and how their results are
written back without copying the stage's buffers, are in `sharding/stage_ops.py`.

What a stage keeps between ticks (every buffer sized by the table's slot allocation):
- inbox  [slots, b, T, D]: messages that arrived and wait for their F or B;
- acts   [slots, Lc, ...]: what each layer's F keeps for its backward, until the chunk's X or
         W (sharding/layer_keep.py): its input, the layer recomputed in the backward
         (`train.remat=full` or `offload`), or its vjp's residuals (`none`, `minimal`);
- stash  [slots, Lc, ...]: what each layer's W reads of its B (the layer's output cotangent,
         or with kept inputs and sharding/split_backward.py's stash the weight products'
         inputs and output cotangents), from B until W;
- ref_logp [M, ...]: the reference head's output per microbatch, read by that microbatch's head
         (on the last chunk's stage; R messages share the inbox).

The embedding and the head run where their chunks do, as Megatron places them: the first
chunk's F embeds its microbatch's tokens when it is due (no stage holds the batch embedded),
its backward forms the embedding's gradient there, and the last chunk's F runs the head and
forms the head's. The outer parameters' gradient is the sum of the two stages' (one stage's
in a V, where both chunks are stage 0's). Every stage runs the same program, so each carries
an accumulator for the outer parameters' gradient (SPMD: buffers are the same on every
stage); only those two write to it.

B and W are the papers' split: B computes the input gradient and hands W each weight
product's operands, so W only forms the weight gradients and B + W costs what X does
(`jaxrl bench pipeline_step` measures the op costs). The price is the stash, several
activations per layer from B to W, where F keeps one. PipeFill (Arfeen et al.) fills bubbles
with other jobs' independent work; the R ops here are the same step's reference forward, with
deadlines (each microbatch's head reads its reference log-probs).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from sharding import schedules as sch
from sharding.layer_keep import keep_for
from sharding.split_backward import trained_part
from sharding.stage_ops import BE, FH, RH, XE, StageModel, apply_delta, branches, replicated

FIELDS = ("op", "chunk", "microbatch", "first", "last", "in_slot", "res_slot", "w_slot", "send",
          "send_slot")


def layer_remat(remat: str) -> str:
    """The remat policy a stage program runs each layer under for `train.remat=remat`. Under
    `full` the programs keep each layer's input between ticks and recompute the layer in B, W
    and X, which is `full` remat already; `offload` keeps the input too and still offloads
    inside an op; under `none` and `minimal` the programs keep what the policy leaves the
    layer's vjp (sharding/layer_keep.py)."""
    return "none" if remat == "full" else remat


def chunk_order(sched: sch.Schedule) -> np.ndarray:
    """[P, V] virtual stage (chunk of the layer stack) each stage holds in each local slot."""
    order = np.zeros((sched.stages, sched.chunks_per_stage), np.int32)
    for k, (s, c) in enumerate(sched.placement):
        order[s, c] = k
    return order


def to_stage_chunks(stacked: dict, sched: sch.Schedule) -> dict:
    """[L, ...] layer parameters -> [P, V, L/K, ...] in the schedule's placement."""
    order = chunk_order(sched)

    def split(a):
        a = a.reshape(sched.chunks, a.shape[0] // sched.chunks, *a.shape[1:])
        if sched.chunks_per_stage == 1 and (order[:, 0] == np.arange(sched.stages)).all():
            return a[:, None]                # stage s holds layers s*L/P..: no data moves
        return a[order]
    return jax.tree.map(split, stacked)


def stage_view(stacked: dict, sched: sch.Schedule) -> dict:
    """[L, ...] layer parameters already in pipeline order (sharding/layer_order.py) ->
    [P, V, L/K, ...], as `to_stage_chunks` lays out canonical ones: a reshape, no data moves."""
    return jax.tree.map(lambda a: a.reshape(sched.stages, sched.chunks_per_stage,
                                            a.shape[0] // sched.chunks, *a.shape[1:]), stacked)


def flat_view(g_PV: dict) -> dict:
    """Inverse of `stage_view`."""
    return jax.tree.map(lambda a: a.reshape(-1, *a.shape[3:]), g_PV)


def from_stage_chunks(g_PV: dict, sched: sch.Schedule) -> dict:
    """Inverse of `to_stage_chunks`."""
    inverse = np.argsort(chunk_order(sched).reshape(-1))

    def merge(a):
        a = a.reshape(sched.chunks, *a.shape[2:])[inverse]
        return a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])
    return jax.tree.map(merge, g_PV)


@dataclasses.dataclass(frozen=True)
class Reference:
    """A frozen reference model run by a table's R ops (`schedules.with_reference`): its
    layers in stage chunks (`to_stage_chunks`), `head_fn(head_params, h_bTD, head_in_b) ->
    array`, whose output the policy's head then finds under `head_in_b["ref_logp"]`, and
    `embed_fn(head_params, ids_bT) -> x_bTD`, its first chunk's input."""

    w_PV: dict
    head_params: dict
    head_fn: Callable
    embed_fn: Callable


@dataclasses.dataclass(frozen=True)
class StageProblem:
    """What a schedule computes the loss and gradients of. `layer_fn(w_l, x_bTD, aux_b) ->
    x_bTD` runs one layer (w_l its parameters); `head_fn(head_params, h_bTD, head_in_b) ->
    (loss, head_aux)` is everything after the last layer for one microbatch, `loss` a scalar;
    `embed_fn(head_params, ids_bT) -> x_bTD` everything before the first, on the microbatch's
    tokens `ids_M[j]` ([M, b, T]); `w_PV` from `to_stage_chunks`; `aux_M` and `head_in_M`
    trees of per-microbatch inputs ([M, ...]). `live_M` [M] bool: microbatches with nothing to
    learn from (RL padding) run no op at all."""

    layer_fn: Callable
    head_fn: Callable
    embed_fn: Callable
    w_PV: dict
    head_params: dict
    ids_M: jax.Array
    aux_M: object
    head_in_M: object
    live_M: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class ScheduleOptions:
    """How the stages run it. `reference`: the model a table with R ops runs (required then).
    `split_how`: how a table with B and W ops splits the layer's backward
    (`sharding.pipeline.split_backward`, sharding/split_backward.py). `replicate_heads`: run
    the heads (the policy's and the reference's) on whole copies of their parameters and
    inputs on every device of the automatic axes, so that no collective runs inside their
    branch (beside both fsdp and tensor, where XLA's partitioner fails on a head sharded over
    both inside a `lax.switch` branch that only some stages take). `trained`: the layer
    weights to differentiate (LoRA's adapters: then the head's parameters get no gradient
    either, {}); None, every weight. `remat`: `train.remat`, which says what each F keeps for
    the backward (`sharding.layer_keep.keep_for`); `problem.layer_fn` runs under its policy
    (`layer_remat`)."""

    reference: Reference | None = None
    split_how: str = "stash"
    replicate_heads: bool = False
    trained: frozenset | None = None
    remat: str = "full"


def run_schedule(sched: sch.Schedule, problem: StageProblem, mesh: Mesh,
                 options: ScheduleOptions = ScheduleOptions()):
    """Loss and gradients of `problem` pipelined by the table `sched` over `mesh`'s stage axis.
    Returns (loss [M], head_aux [M, ...], float32 gradients of sum(loss) w.r.t. w_PV (its
    `trained` part) and head_params (the embedding's and the head's))."""
    if sched.reference != (options.reference is not None):
        raise ValueError(f"{sched.name}: a table with R ops needs a reference model, and only "
                         f"such a table takes one (R ops: {sched.reference})")
    if problem.live_M is None:
        problem = dataclasses.replace(problem, live_M=jnp.ones((problem.ids_M.shape[0],), bool))
    trained = options.trained
    head = functools.partial(_head_and_grads, problem.head_fn, frozen=trained is not None)
    x_spec = jax.eval_shape(problem.embed_fn, problem.head_params, problem.ids_M[0])
    shapes = _head_shapes(head, problem.head_params, x_spec, problem.head_in_M,
                          options.reference)
    program = _stage_program(sched, problem, options, head, shapes)
    grads_of = (trained_part(problem.w_PV, trained)[0],
                {} if trained is not None else problem.head_params)
    g_w, g_head, loss, aux = _on_stages(program, mesh, problem, options.reference, grads_of,
                                        shapes[2])
    first_stage, last_stage = sched.placement[0][0], sched.placement[-1][0]
    take = lambda tree, s: jax.tree.map(lambda a: a[s], tree)  # noqa: E731
    g_outer = take(g_head, last_stage)
    if first_stage != last_stage:   # the embedding's stage and the head's: tied, one sum
        g_outer = jax.tree.map(jnp.add, g_outer, take(g_head, first_stage))
    return loss[last_stage], take(aux, last_stage), g_w, g_outer


def _stage_program(sched: sch.Schedule, problem: StageProblem, options: ScheduleOptions, head,
                   shapes: tuple) -> Callable:
    """What each stage runs: the table's ticks in a scan, each tick its op (a `lax.switch`
    over `branches`), then its gradients, input gradients, losses and aux. `shapes`: the
    reference log-probs', the loss's and the aux's (`_head_shapes`)."""
    table = sch.as_arrays(sched)
    rows = jnp.asarray(np.stack([table[f] for f in FIELDS], axis=-1))      # [ticks, P, fields]
    slots, p, trained = table["slots"], sched.stages, options.trained
    ref_shape, loss_shape, aux_shape = shapes
    reference = options.reference

    def program(w_1V, hp, ids_M, aux, live, ref):
        hp, ref = _whole_heads(hp, ref) if options.replicate_heads else (hp, ref)
        w_V = jax.tree.map(lambda a: a[0], w_1V)
        stage = jax.lax.axis_index("stage")
        layers = jax.tree.leaves(w_V)[0].shape[1]
        grads_like = (trained_part(w_V, trained)[0], {} if trained is not None else hp)
        x_spec = jax.eval_shape(problem.embed_fn, hp, ids_M[0])
        keep = keep_for(options.remat, problem.layer_fn, jax.tree.map(lambda a: _spec(a, 2), w_V),
                        x_spec, jax.tree.map(lambda a: _spec(a, 1), aux), trained,
                        options.split_how if sched.split else None)
        state = _empty_state(slots, layers, x_spec, keep.shapes(), ids_M.shape[0], grads_like,
                             (loss_shape, aux_shape))
        if sched.split:
            state["stash"] = tuple(jnp.zeros((slots["w"], layers, *s.shape), s.dtype)
                                   for s in keep.stash_shapes())
        if ref is not None:
            ref = {**ref, "w_V": jax.tree.map(lambda a: a[0], ref["w_1V"])}
            state["ref_logp"] = jnp.zeros((ids_M.shape[0], *ref_shape.shape), ref_shape.dtype)
        model = StageModel(problem.layer_fn, head, problem.embed_fn, w_V, hp, ids_M, x_spec,
                           aux, problem.head_in_M, keep, sched.split, ref,
                           None if reference is None else reference.head_fn,
                           None if reference is None else reference.embed_fn,
                           replicate_heads=options.replicate_heads, trained=trained)
        ops = branches(model, ((loss_shape, aux_shape), ref_shape))
        read_only = [k for k in ("inbox", "acts", "stash", "ref_logp") if k in state]

        def tick(state, rows_t):
            row = dict(zip(FIELDS, rows_t[stage]))
            op = jnp.where(live[row["microbatch"]], row["op"], sch.IDLE)
            op = jnp.where((op == sch.F) & (row["last"] == 1), FH, op)
            op = jnp.where((op == sch.R) & (row["last"] == 1), RH, op)
            op = jnp.where((op == sch.X) & (row["first"] == 1), XE, op)
            op = jnp.where((op == sch.B) & (row["first"] == 1), BE, op)
            grads, delta = jax.lax.switch(op, ops, {k: state[k] for k in read_only},
                                          {k: state[k] for k in ("g_w", "g_head")}, row)
            state = apply_delta({**state, **grads}, delta, op, row)
            state["inbox"] = _deliver(state["inbox"], delta["send"], row, p)
            return state, None

        state, _ = jax.lax.scan(tick, state, rows)
        lead = lambda tree: jax.tree.map(lambda a: a[None], tree)  # noqa: E731
        return (lead(state["g_w"]), lead(state["g_head"]), state["loss"][None],
                lead(state["aux"]))

    return program


def _empty_state(slots: dict, layers: int, x_spec, kept: tuple, m: int, grads_like: tuple,
                 loss_aux: tuple) -> dict:
    """What a stage carries from tick to tick, zeroed: its inbox (one microbatch's first input
    is `x_spec`), what its layers keep for the backward (`kept`: one layer's shapes), float32
    gradient accumulators shaped like `grads_like` (layer weights, outer parameters), and per
    microbatch (`m` of them) the loss and the head's aux (`loss_aux` shapes)."""
    mb_shape, dt = x_spec.shape, x_spec.dtype
    f32 = lambda a: jnp.zeros(a.shape, jnp.float32)  # noqa: E731
    loss_shape, aux_shape = loss_aux
    return {"inbox": jnp.zeros((slots["inbox"], *mb_shape), dt),
            "acts": tuple(jnp.zeros((slots["res"], layers, *s.shape), s.dtype) for s in kept),
            "g_w": jax.tree.map(f32, grads_like[0]), "g_head": jax.tree.map(f32, grads_like[1]),
            "loss": jnp.zeros((m,), loss_shape.dtype),
            "aux": jax.tree.map(lambda s: jnp.zeros((m, *s.shape), s.dtype), aux_shape)}


def _head_and_grads(head_fn, hp, h_bTD, head_in, ref_logp=None, *, frozen: bool = False):
    """The head on one microbatch: (loss, aux, its gradient w.r.t. the head's parameters ({}
    when `frozen`) and w.r.t. its input), with the reference's log-probs in its inputs when
    given."""
    if ref_logp is not None:
        head_in = {**head_in, "ref_logp": ref_logp}
    if frozen:
        loss, pull, head_aux = jax.vjp(lambda h: head_fn(hp, h, head_in), h_bTD, has_aux=True)
        return loss, head_aux, {}, pull(jnp.ones_like(loss))[0]
    loss, pull, head_aux = jax.vjp(lambda hp_, h: head_fn(hp_, h, head_in), hp, h_bTD,
                                   has_aux=True)
    g_hp, g_h = pull(jnp.ones_like(loss))
    return loss, head_aux, g_hp, g_h


def _whole_heads(hp, ref):
    """The heads' parameters (the policy's, and the reference's if any) whole on every device
    of the automatic axes."""
    if ref is not None:
        ref = {**ref, "head_params": replicated(ref["head_params"])}
    return replicated(hp), ref


def _head_shapes(head, head_params, x_spec, head_in_M, reference: Reference | None):
    """Shapes of one microbatch's reference log-probs (None without a reference), the
    policy head's loss and its aux."""
    first = jax.tree.map(lambda a: a[0], head_in_M)
    ref_shape = None
    if reference is not None:
        ref_shape = jax.eval_shape(lambda hp, h: reference.head_fn(hp, h, first),
                                   reference.head_params, x_spec)
    loss_shape, aux_shape, _, _ = jax.eval_shape(
        head, head_params, x_spec, first,
        None if ref_shape is None else jnp.zeros(ref_shape.shape, ref_shape.dtype))
    return ref_shape, loss_shape, aux_shape


def _on_stages(program, mesh: Mesh, problem: StageProblem, reference: Reference | None,
               grads_of: tuple, aux_shape):
    """`program` run on every stage (shard_map over the stage axis): the chunks of layers and
    the outputs split by stage, everything else whole. `grads_of`: the (layer, head) weights
    the program returns gradients of; `aux_shape`: the head's aux for one microbatch."""
    stage_spec = lambda tree: jax.tree.map(lambda _: P("stage"), tree)  # noqa: E731
    whole_spec = lambda tree: jax.tree.map(lambda _: P(), tree)  # noqa: E731
    ref = None if reference is None else {
        "w_1V": reference.w_PV, "head_params": reference.head_params}
    ref_spec = None if ref is None else {
        "w_1V": stage_spec(ref["w_1V"]), "head_params": whole_spec(ref["head_params"])}
    out_specs = (stage_spec(grads_of[0]), stage_spec(grads_of[1]), P("stage"),
                 stage_spec(aux_shape))
    run = jax.shard_map(program, mesh=mesh, axis_names={"stage"}, check_vma=False,
                        in_specs=(stage_spec(problem.w_PV), whole_spec(problem.head_params), P(),
                                  whole_spec(problem.aux_M), P(), ref_spec),
                        out_specs=out_specs)
    return run(problem.w_PV, problem.head_params, problem.ids_M, problem.aux_M, problem.live_M,
               ref)


def _deliver(inbox, out, row, p: int):
    """Sends this tick's output to its destination and files what arrives into the inbox.
    Each message carries the receiver's slot, or -1 when nothing is sent that way."""
    forward = [(i, (i + 1) % p) for i in range(p)]
    backward = [(i, (i - 1) % p) for i in range(p)]
    slot_for = lambda send: jnp.where(row["send"] == send, row["send_slot"], -1)  # noqa: E731
    from_prev, slot_prev = jax.lax.ppermute((out, slot_for(1)), "stage", forward)
    from_next, slot_next = jax.lax.ppermute((out, slot_for(2)), "stage", backward)
    nowhere = inbox.shape[0]          # out of bounds: the write is dropped
    for slot, payload in ((slot_prev, from_prev), (slot_next, from_next), (slot_for(3), out)):
        inbox = inbox.at[jnp.where(slot >= 0, slot, nowhere)].set(payload, mode="drop")
    return inbox


def _spec(a, drop: int) -> jax.ShapeDtypeStruct:
    """The shape and dtype of one of `a`'s entries along its first `drop` axes."""
    return jax.ShapeDtypeStruct(a.shape[drop:], a.dtype)
