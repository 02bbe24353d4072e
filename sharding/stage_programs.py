"""Per-stage pipeline programs: each stage follows its own row of a schedule table.

A `shard_map` over the mesh's `stage` axis (the fsdp, tensor and data axes stay automatic
inside it) runs one `lax.scan` over the table's ticks. At every tick a stage reads its row
(op, chunk, microbatch, buffer slots) and `lax.switch` runs only that op: F, B, W, X (B and W
together), F of the last chunk with the head, R (the reference model's forward, PipeFill), R of
the last chunk with the reference head, or nothing. Its output (an activation going
forward, a cotangent going back) moves to the neighbour stage by `ppermute`, with the slot the
receiver keeps it in, or stays on the stage (a V's turn, the head's cotangent). Stage s
therefore runs F of microbatch 5 while stage s+1 runs B of microbatch 2: the schedules of
`sharding/schedules.py` run as written, not in lock step.

What a stage keeps between ticks (every buffer sized by the table's slot allocation):
- inbox  [slots, b, T, D]: messages that arrived and wait for their F or B;
- acts   [slots, Lc, b, T, D]: each layer's input from an F, until the chunk's X or W (the
         backward recomputes each layer from its input: full remat at layer granularity);
- cotangents [slots, Lc, b, T, D]: each layer's output cotangent from a B, until its W;
- ref_logp [M, ...]: the reference head's output per microbatch, read by that microbatch's head
         (on the last chunk's stage; R messages share the inbox).

Departures from the papers: ZB's W here recomputes the layer forward and the part of the
layer's backward that the weight gradients need (the papers keep the intermediate gradients
from B instead), so a split B + W costs more than X; the op costs reported by
`jaxrl bench pipeline_step` are measured, not assumed. PipeFill (Arfeen et al.) fills bubbles
with other jobs' independent work; the R ops here are the same step's reference forward, with
deadlines (each microbatch's head reads its reference log-probs).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from sharding import schedules as sch

FIELDS = ("op", "chunk", "microbatch", "first", "last", "in_slot", "res_slot", "w_slot", "send",
          "send_slot")
FH = len(sch.OPS)       # branch index of F on the last chunk (forward, then the head)
RH = FH + 1             # branch index of R on the last chunk (reference forward and head)


def layer_remat(remat: str) -> str:
    """The remat policy a stage program runs each layer under for `train.remat=remat`: the
    programs keep only each layer's input between ticks and recompute the layer in B, W and X,
    which is `full` remat already; `minimal` and `offload` still shape the one layer's
    activations inside an op."""
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
    layers in stage chunks (`to_stage_chunks`), its embedded microbatches [M, b, T, D], and
    `head_fn(head_params, h_bTD, head_in_b) -> array`, whose output the policy's head then
    finds under `head_in_b["ref_logp"]`."""

    w_PV: dict
    head_params: dict
    x_MbTD: jax.Array
    head_fn: Callable


def run_schedule(sched: sch.Schedule, layer_fn: Callable, head_fn: Callable, w_PV,
                 head_params, x_MbTD, aux_M, head_in_M, mesh: Mesh, live_M=None,
                 reference: Reference | None = None):
    """Loss and gradients of a pipelined model by the table `sched`.

    `layer_fn(w_l, x_bTD, aux_b) -> x_bTD` runs one layer (w_l its parameters); `head_fn(
    head_params, h_bTD, head_in_b) -> (loss, head_aux)` is everything after the last layer for
    one microbatch, `loss` a scalar; `w_PV` from `to_stage_chunks`; `aux_M` and `head_in_M`
    trees of per-microbatch inputs ([M, ...]). `live_M` [M] bool: microbatches with nothing to
    learn from (RL padding) run no op at all. `reference`: the model a table with R ops runs
    (required then). Returns (loss [M], head_aux [M, ...], float32 gradients of sum(loss)
    w.r.t. w_PV and head_params, and w.r.t. x_MbTD)."""
    if sched.reference != (reference is not None):
        raise ValueError(f"{sched.name}: a table with R ops needs a reference model, and only "
                         f"such a table takes one (R ops: {sched.reference})")
    table = sch.as_arrays(sched)
    rows = jnp.asarray(np.stack([table[f] for f in FIELDS], axis=-1))      # [ticks, P, fields]
    slots = table["slots"]
    split = sched.split
    p, m = sched.stages, x_MbTD.shape[0]
    last_stage = sched.placement[-1][0]
    if live_M is None:
        live_M = jnp.ones((m,), bool)

    def head(hp, h_bTD, j, ref_logp=None):
        head_in = jax.tree.map(lambda a: a[j], head_in_M)
        if ref_logp is not None:
            head_in = {**head_in, "ref_logp": ref_logp}
        loss, pull, head_aux = jax.vjp(lambda hp_, h: head_fn(hp_, h, head_in), hp, h_bTD,
                                       has_aux=True)
        g_hp, g_h = pull(jnp.ones_like(loss))
        return loss, head_aux, g_hp, g_h

    ref_shape = None
    if reference is not None:
        ref_shape = jax.eval_shape(
            lambda hp, h: reference.head_fn(hp, h, jax.tree.map(lambda a: a[0], head_in_M)),
            reference.head_params, x_MbTD[0])
    loss_shape, aux_shape, _, _ = jax.eval_shape(
        head, head_params, x_MbTD[0], 0,
        None if ref_shape is None else jnp.zeros(ref_shape.shape, ref_shape.dtype))
    stage_spec = lambda tree: jax.tree.map(lambda _: P("stage"), tree)  # noqa: E731
    whole_spec = lambda tree: jax.tree.map(lambda _: P(), tree)  # noqa: E731

    def program(w_1V, hp, x_M, aux, live, ref):
        w_V = jax.tree.map(lambda a: a[0], w_1V)
        stage = jax.lax.axis_index("stage")
        layers = jax.tree.leaves(w_V)[0].shape[1]
        mb_shape, dt = x_M.shape[1:], x_M.dtype
        f32 = lambda a: jnp.zeros(a.shape, jnp.float32)  # noqa: E731
        state = {
            "inbox": jnp.zeros((slots["inbox"], *mb_shape), dt),
            "acts": jnp.zeros((slots["res"], layers, *mb_shape), dt),
            "g_w": jax.tree.map(f32, w_V), "g_head": jax.tree.map(f32, hp),
            "dx": jnp.zeros_like(x_M), "loss": jnp.zeros((m,), loss_shape.dtype),
            "aux": jax.tree.map(lambda s: jnp.zeros((m, *s.shape), s.dtype), aux_shape),
        }
        if split:
            state["cot"] = jnp.zeros((slots["w"], layers, *mb_shape), dt)
        if ref is not None:
            ref = {**ref, "w_V": jax.tree.map(lambda a: a[0], ref["w_1V"])}
            state["ref_logp"] = jnp.zeros((m, *ref_shape.shape), ref_shape.dtype)
        ops = _stage_ops(layer_fn, head, w_V, hp, x_M, aux, set(state), ref, head_in_M,
                         None if reference is None else reference.head_fn)

        def tick(state, rows_t):
            row = dict(zip(FIELDS, rows_t[stage]))
            op = jnp.where(live[row["microbatch"]], row["op"], sch.IDLE)
            op = jnp.where((op == sch.F) & (row["last"] == 1), FH, op)
            op = jnp.where((op == sch.R) & (row["last"] == 1), RH, op)
            state, out = jax.lax.switch(op, ops, state, row)
            state["inbox"] = _deliver(state["inbox"], out, row, p)
            return state, None

        state, _ = jax.lax.scan(tick, state, rows)
        return (jax.tree.map(lambda a: a[None], state["g_w"]),
                jax.tree.map(lambda a: a[None], state["g_head"]), state["dx"][None],
                state["loss"][None], jax.tree.map(lambda a: a[None], state["aux"]))

    ref = None if reference is None else {
        "w_1V": reference.w_PV, "head_params": reference.head_params, "x_M": reference.x_MbTD}
    ref_spec = None if ref is None else {
        "w_1V": stage_spec(ref["w_1V"]), "head_params": whole_spec(ref["head_params"]),
        "x_M": P()}
    out_specs = (stage_spec(w_PV), stage_spec(head_params), P("stage"), P("stage"),
                 stage_spec(aux_shape))
    run = jax.shard_map(program, mesh=mesh, axis_names={"stage"}, check_vma=False,
                        in_specs=(stage_spec(w_PV), whole_spec(head_params), P(),
                                  whole_spec(aux_M), P(), ref_spec),
                        out_specs=out_specs)
    g_w, g_head, dx, loss, aux = run(w_PV, head_params, x_MbTD, aux_M, live_M, ref)
    take = lambda tree, s: jax.tree.map(lambda a: a[s], tree)  # noqa: E731
    return (loss[last_stage], take(aux, last_stage), g_w, take(g_head, last_stage), dx[0])


def _deliver(inbox, out, row, p: int):
    """Sends this tick's output to its destination and files what arrives into the inbox.
    Each message carries the receiver's slot, or -1 when nothing is sent that way."""
    forward = [(i, (i + 1) % p) for i in range(p)]
    backward = [(i, (i - 1) % p) for i in range(p)]
    slot_for = lambda send: jnp.where(row["send"] == send, row["send_slot"], -1)  # noqa: E731
    from_prev, slot_prev = jax.lax.ppermute((out, slot_for(1)), "stage", forward)
    from_next, slot_next = jax.lax.ppermute((out, slot_for(2)), "stage", backward)
    for slot, payload in ((slot_prev, from_prev), (slot_next, from_next), (slot_for(3), out)):
        inbox = inbox.at[slot].set(jnp.where(slot >= 0, payload, inbox[slot]))
    return inbox


def _stage_ops(layer_fn, head, w_V, hp, x_M, aux_M, state_keys, ref, head_in_M, ref_head_fn):
    """The `lax.switch` branches, indexed by op code (idle, F, B, W, X, busy, R, then F with
    the head and R with the reference head): each takes (state, row) and returns (state, the
    message it sends). `ref`: the reference model's arrays on this stage, or None."""
    take = lambda tree, j: jax.tree.map(lambda a: a[j], tree)  # noqa: E731

    def add_grads(state, c, dws):
        state["g_w"] = jax.tree.map(lambda acc, g: acc.at[c].add(g.astype(jnp.float32)),
                                    state["g_w"], dws)
        return state

    def forward(state, row):
        c, j = row["chunk"], row["microbatch"]
        x = jnp.where(row["first"] == 1, x_M[j], state["inbox"][row["in_slot"]])
        aux = take(aux_M, j)
        y, xs = jax.lax.scan(lambda h, w_l: (layer_fn(w_l, h, aux), h), x, take(w_V, c))
        state = {**state, "acts": state["acts"].at[row["res_slot"]].set(xs)}
        return state, y

    def forward_head(state, row):
        state, y = forward(state, row)
        j = row["microbatch"]
        ref_logp = state["ref_logp"][j] if "ref_logp" in state else None
        loss, head_aux, g_hp, g_y = head(hp, y, j, ref_logp)
        state["loss"] = state["loss"].at[j].set(loss)
        state["aux"] = jax.tree.map(lambda buf, a: buf.at[j].set(a), state["aux"], head_aux)
        state["g_head"] = jax.tree.map(lambda acc, g: acc + g.astype(jnp.float32),
                                       state["g_head"], g_hp)
        return state, g_y.astype(y.dtype)

    def backward(state, row, weights: bool, keep_cotangents: bool):
        c, j = row["chunk"], row["microbatch"]
        aux = take(aux_M, j)

        def layer_back(g, w_x):
            w_l, x_l = w_x
            if weights:
                _, pull = jax.vjp(lambda w, x: layer_fn(w, x, aux), w_l, x_l)
                dw, dx = pull(g)
            else:
                _, pull = jax.vjp(lambda x: layer_fn(w_l, x, aux), x_l)
                (dx,), dw = pull(g), None
            return dx.astype(g.dtype), (dw, g)

        g = state["inbox"][row["in_slot"]]
        dx, (dws, gs) = jax.lax.scan(layer_back, g, (take(w_V, c), state["acts"][row["res_slot"]]),
                                     reverse=True)
        state = dict(state)
        if weights:
            state = add_grads(state, c, dws)
        if keep_cotangents:
            state["cot"] = state["cot"].at[row["w_slot"]].set(gs)
        state["dx"] = state["dx"].at[j].set(jnp.where(row["first"] == 1, dx, state["dx"][j]))
        return state, dx

    def weight_grads(state, row):
        c, j = row["chunk"], row["microbatch"]
        aux = take(aux_M, j)

        def layer_w(_, w_x_g):
            w_l, x_l, g_l = w_x_g
            _, pull = jax.vjp(lambda w: layer_fn(w, x_l, aux), w_l)
            return None, pull(g_l)[0]

        _, dws = jax.lax.scan(layer_w, None, (take(w_V, c), state["acts"][row["res_slot"]],
                                               state["cot"][row["w_slot"]]))
        return add_grads(dict(state), c, dws), jnp.zeros_like(x_M[0])

    def nothing(state, row):
        return state, jnp.zeros_like(x_M[0])

    def reference_forward(state, row):
        c, j = row["chunk"], row["microbatch"]
        x = jnp.where(row["first"] == 1, ref["x_M"][j], state["inbox"][row["in_slot"]])
        aux = take(aux_M, j)
        y, _ = jax.lax.scan(lambda h, w_l: (layer_fn(w_l, h, aux), None), x,
                            take(ref["w_V"], c))
        return state, y

    def reference_head(state, row):
        state, y = reference_forward(state, row)
        j = row["microbatch"]
        out = ref_head_fn(ref["head_params"], y, take(head_in_M, j))
        return {**state, "ref_logp": state["ref_logp"].at[j].set(out)}, jnp.zeros_like(y)

    split = "cot" in state_keys
    return [nothing, forward,
            partial(backward, weights=False, keep_cotangents=True) if split else nothing,
            weight_grads if split else nothing,
            partial(backward, weights=True, keep_cotangents=False), nothing,
            reference_forward if ref is not None else nothing, forward_head,
            reference_head if ref is not None else nothing]
