"""HelixPipe's per-stage program: the schedule of sharding/helix.py run by one SPMD program.

A `shard_map` over the mesh's `stage` axis (the other axes stay automatic inside it) runs the
forward rounds in one `lax.scan` and the backward rounds in a second, reversed. In each
round, for every wave slot (offset d, fold e):

- forward: the stage's P op (boundary i of the wave it holds: post(i-1), pre(i)) sends q, k,
  v and the residual stream by a collective permute of shift d+1; the receiving stage's A op
  keeps q, k, v, computes the attention and sends the residual stream and the attention's
  output by a shift of -d into the inbox of stage i+1, which reads it the next round.
- backward: the A op takes the cotangents boundary i+1 sent it the round before, recomputes
  its attention from the kept q, k, v and sends their gradients back by -(d+1); the P op
  recomputes its weighted parts from its kept input (never an attention), adds its weight
  gradients and sends the residual's and the attention output's cotangents on by +d.

Boundary L (stage 0) runs the head: in the backward rounds, so the loss and its gradient are
computed where the backward starts and no cotangent waits a whole forward pass in memory.
Each message carries whether it is real and which microbatch and boundary it belongs to; an
op with nothing to do (a stage without a wave this round, a padded RL microbatch) skips its
compute, and the permutes run anyway (every stage takes part in every collective).

Buffers are written outside the ops' branches, one microbatch's slot at a time (a branch
that returned a buffer would copy it, sharding/stage_ops.py).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from sharding.helix import HelixPlan
from sharding.stage_ops import replicated

IDLE, FIRST, MID, LAST = range(4)


@dataclasses.dataclass(frozen=True)
class LayerParts:
    """One layer in HelixPipe's three parts and the head, for one microbatch:
    `pre(w_in, y, aux) -> (q, k, v)`, `attend(q, k, v, aux) -> a`, `post(w_out, r, a, aux)
    -> y`, `head(head_params, h, head_in) -> (loss, head_aux)`; `aux` is the microbatch's
    per-token inputs (positions, segment ids)."""

    pre: Callable
    attend: Callable
    post: Callable
    head: Callable


@dataclasses.dataclass(frozen=True)
class HelixInputs:
    """What the helix schedule differentiates and runs on. `w_in_PV` / `w_out_PV`: [P, L/P,
    ...] the input side of layer s + kP and the output side of layer s + kP - 1 on stage s,
    slot k (`jaxrl.train.helix_step.helix_layout`); `x_MbTD` the embedded microbatches;
    `aux_M`, `head_in_M` trees of per-microbatch inputs; `live_M` [M] bool (False: a padded
    microbatch, no op runs; None: all run)."""

    w_in_PV: dict
    w_out_PV: dict
    head_params: dict
    x_MbTD: jax.Array
    aux_M: object
    head_in_M: object
    live_M: jax.Array | None = None


def run_helix(plan: HelixPlan, parts: LayerParts, inputs: HelixInputs, mesh: Mesh,
              replicate_heads: bool = False):
    """Loss and gradients by the helix schedule. `replicate_heads` as in
    `stage_programs.run_schedule`. Returns (loss [M], head_aux [M, ...], float32 gradients
    w.r.t. w_in_PV, w_out_PV and head_params, and x_MbTD's)."""
    w_in_PV, w_out_PV, head_params = inputs.w_in_PV, inputs.w_out_PV, inputs.head_params
    x_MbTD, aux_M, head_in_M = inputs.x_MbTD, inputs.aux_M, inputs.head_in_M
    m = x_MbTD.shape[0]
    live_M = jnp.ones((m,), bool) if inputs.live_M is None else inputs.live_M
    table = plan.table()
    rows = jnp.stack([jnp.asarray(table["wave"]), jnp.asarray(table["boundary"])], -1)
    first = lambda tree: jax.tree.map(lambda a: a[0], tree)  # noqa: E731
    qkv_shape = jax.eval_shape(parts.pre, first(first(w_in_PV)), x_MbTD[0], first(aux_M))
    a_shape = jax.eval_shape(parts.attend, *qkv_shape, first(aux_M))
    loss_shape, aux_shape = jax.eval_shape(parts.head, head_params, x_MbTD[0],
                                           first(head_in_M))
    shapes = _Shapes(qkv_shape, a_shape, loss_shape, aux_shape)

    def program(w_in_1V, w_out_1V, hp, x_M, aux, head_in, live):
        hp = replicated(hp) if replicate_heads else hp
        ctx = _Stage(plan, parts, first(w_in_1V), first(w_out_1V), hp, x_M, aux, head_in,
                     live, shapes, replicate_heads)
        kept, _ = jax.lax.scan(ctx.forward_round, ctx.forward_state(), rows)
        state, _ = jax.lax.scan(ctx.backward_round, ctx.backward_state(kept), rows,
                                reverse=True)
        lead = lambda tree: jax.tree.map(lambda a: a[None], tree)  # noqa: E731
        return (lead(state["g_in"]), lead(state["g_out"]), lead(state["g_head"]),
                state["dx"][None], state["loss"][None], lead(state["aux"]))

    stage_spec = lambda tree: jax.tree.map(lambda _: P("stage"), tree)  # noqa: E731
    whole_spec = lambda tree: jax.tree.map(lambda _: P(), tree)  # noqa: E731
    run = jax.shard_map(
        program, mesh=mesh, axis_names={"stage"}, check_vma=False,
        in_specs=(stage_spec(w_in_PV), stage_spec(w_out_PV), whole_spec(head_params), P(),
                  whole_spec(aux_M), whole_spec(head_in_M), P()),
        out_specs=(stage_spec(w_in_PV), stage_spec(w_out_PV), stage_spec(head_params),
                   P("stage"), P("stage"), stage_spec(aux_shape)))
    g_in, g_out, g_head, dx, loss, aux = run(w_in_PV, w_out_PV, head_params, x_MbTD, aux_M,
                                             head_in_M, live_M)
    on_first = lambda tree: jax.tree.map(lambda a: a[0], tree)  # noqa: E731
    return loss[0], on_first(aux), g_in, g_out, on_first(g_head), dx[0]


class _Op(NamedTuple):
    """A P op of a stage in a round: microbatch `j`, layer boundary `i`, whether it runs
    (`on`), its `kind` (IDLE, FIRST, MID, LAST), and the slots of its input and output sides
    among the stage's layers (`k`, `k_out`)."""

    j: jax.Array
    i: jax.Array
    on: jax.Array
    kind: jax.Array
    k: jax.Array
    k_out: jax.Array


@dataclasses.dataclass(frozen=True)
class _Shapes:
    qkv: tuple
    a: jax.ShapeDtypeStruct
    loss: jax.ShapeDtypeStruct
    aux: object


def _zeros(shape_tree, lead=()):
    return jax.tree.map(lambda s: jnp.zeros((*lead, *s.shape), s.dtype), shape_tree)


def _f32_zeros(tree):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)


def _put(buf, index, value, on):
    """buf[index] = value where `on`, in place; nothing written otherwise (the index points
    past the buffer and the write is dropped)."""
    index = tuple(jnp.where(on, i, buf.shape[0] if n == 0 else 0) for n, i in enumerate(index))
    return buf.at[index].set(value.astype(buf.dtype), mode="drop")


def _stack(trees: list):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _shift(tree, d: int, p: int):
    """`tree` sent from every stage s to stage s + d (mod p)."""
    d %= p
    if d == 0:
        return tree
    return jax.lax.ppermute(tree, "stage", [(s, (s + d) % p) for s in range(p)])


@dataclasses.dataclass(frozen=True)
class _Stage:
    """One stage's view inside the program: its weights, inputs and the ops' bodies."""

    plan: HelixPlan
    parts: LayerParts
    w_in: dict            # [L/P, ...] input sides of this stage's layers
    w_out: dict           # [L/P, ...] output sides
    hp: dict
    x_M: jax.Array
    aux_M: object
    head_in_M: object
    live: jax.Array
    shapes: _Shapes
    replicate_heads: bool

    @property
    def stage(self):
        return jax.lax.axis_index("stage")

    def _slot(self, row, slot) -> "_Op":
        """This stage's P op for a wave slot in a round."""
        p, L = self.plan.stages, self.plan.layers
        g, i = row[self.stage, 0], row[self.stage, 1]
        j = jnp.clip(g, 0) * self.plan.wave + slot
        on = (g >= 0) & self.live[j]
        kind = jnp.where(~on, IDLE, jnp.where(i == 0, FIRST, jnp.where(i == L, LAST, MID)))
        return _Op(j, i, on, kind, i // p, (i // p) % (L // p))

    def _aux(self, j):
        return jax.tree.map(lambda a: a[j], self.aux_M)

    # Forward ----------------------------------------------------------------------------

    def forward_state(self) -> dict:
        m, K, V = self.x_M.shape[0], self.plan.slots_per_stage, self.plan.layers // self.plan.stages
        wave, mb = self.plan.wave, self.x_M[0]
        return {"inbox": (jnp.zeros((wave, *mb.shape), mb.dtype), _zeros(self.shapes.a, (wave,))),
                "kept_in": (jnp.zeros((m, K, *mb.shape), mb.dtype),
                            _zeros(self.shapes.a, (m, K))),
                "kept_qkv": _zeros(self.shapes.qkv, (m, V))}

    def forward_round(self, state, row):
        """One round: every slot's P op, each sending its q, k, v by d+1; then the A ops of
        what each stage received, all stages at once; then their outputs by -d into the
        inbox the next round's P ops read."""
        p, f = self.plan.stages, self.plan.folds
        kept_in, sent = state["kept_in"], []
        for d in range(p):
            for e in range(f):
                kept_in, msg = self._p_forward(kept_in, state["inbox"], row, d * f + e)
                sent.append(_shift(msg, d + 1, p))
        received = _stack(sent)
        kept_qkv, a = self._attend_received(state["kept_qkv"], received)
        back = [_shift((received[1][s], a[s]), -(s // f), p) for s in range(p * f)]
        return {"inbox": _stack(back), "kept_in": kept_in, "kept_qkv": kept_qkv}, None

    def _p_forward(self, kept_in, inbox, row, slot):
        """This stage's P op for a wave slot: its input kept, and the message (q, k, v, the
        residual stream, (real, microbatch, boundary)) for the stage that attends."""
        j, i, on, kind, k, k_out = self._slot(row, slot)
        r_in = jnp.where(i == 0, self.x_M[j], inbox[0][slot])
        a_in = inbox[1][slot]
        kept_in = (_put(kept_in[0], (j, k), r_in, on), _put(kept_in[1], (j, k), a_in, on))
        w_in, w_out = self._weights(k, k_out)
        aux = self._aux(j)
        zero = lambda: (_zeros(self.shapes.qkv), jnp.zeros_like(r_in))  # noqa: E731
        branches = [zero,
                    lambda: (self.parts.pre(w_in, r_in, aux), r_in),
                    lambda: self._pre_post(w_in, w_out, r_in, a_in, aux),
                    zero]
        qkv, y = jax.lax.switch(kind, branches)
        return kept_in, (qkv, y, (on & (i < self.plan.layers), j, i))

    def _attend_received(self, kept_qkv, received):
        """The A ops of the messages this stage received, real ones first, so that a stage
        with one attention to run runs it in the round's first A tick, beside every other
        stage's (the attention parallel partition). Returns (kept q, k, v, outputs by slot)."""
        qkv, _, (valid, j, i) = received
        p = self.plan.stages
        order = jnp.argsort(~valid, stable=True)
        out = _zeros(self.shapes.a, (valid.shape[0],))
        for t in range(valid.shape[0]):
            n = order[t]
            q_n = jax.tree.map(lambda a: a[n], qkv)
            kept_qkv = tuple(_put(buf, (j[n], i[n] // p), x, valid[n])
                             for buf, x in zip(kept_qkv, q_n))
            a = jax.lax.cond(valid[n], lambda: self.parts.attend(*q_n, self._aux(j[n])),
                             lambda: _zeros(self.shapes.a))
            out = out.at[n].set(a)
        return kept_qkv, out

    def _weights(self, k, k_out):
        V = self.plan.layers // self.plan.stages
        take = lambda tree, i: jax.tree.map(lambda a: a[jnp.clip(i, 0, V - 1)], tree)  # noqa: E731
        return take(self.w_in, k), take(self.w_out, k_out)

    def _pre_post(self, w_in, w_out, r, a, aux):
        y = self.parts.post(w_out, r, a, aux)
        return self.parts.pre(w_in, y, aux), y

    # Backward ---------------------------------------------------------------------------

    def backward_state(self, kept: dict) -> dict:
        m, wave, mb = self.x_M.shape[0], self.plan.wave, self.x_M[0]
        meta = (jnp.zeros((wave,), bool), jnp.zeros((wave,), jnp.int32),
                jnp.zeros((wave,), jnp.int32))
        return {"kept_in": kept["kept_in"], "kept_qkv": kept["kept_qkv"],
                "cot": (jnp.zeros((wave, *mb.shape), mb.dtype), _zeros(self.shapes.a, (wave,)),
                        meta),
                "g_in": _f32_zeros(self.w_in), "g_out": _f32_zeros(self.w_out),
                "g_head": _f32_zeros(self.hp),
                "dx": jnp.zeros_like(self.x_M), "loss": _zeros(self.shapes.loss, (m,)),
                "aux": _zeros(self.shapes.aux, (m,))}

    def backward_round(self, state, row):
        """One reversed round: the A ops' backward on the cotangents the last round sent (all
        stages at once, as in the forward), their q/k/v gradients by -(d+1) to every slot's
        P op, whose input cotangents go by +d to the next round's A ops."""
        p, f = self.plan.stages, self.plan.folds
        dqkv = self._attend_backward(state["kept_qkv"], state["cot"])
        sent = []
        for d in range(p):
            for e in range(f):
                slot = d * f + e
                grads = jax.tree.map(lambda a: a[slot], (dqkv, state["cot"][0]))
                state, msg = self._p_backward_slot(state, row, slot, *_shift(grads, -(d + 1), p))
                sent.append(_shift(msg, d, p))
        return {**state, "cot": _stack(sent)}, None

    def _attend_backward(self, kept_qkv, cot):
        """q, k, v's gradients of each received cotangent's attention, by slot (real ones
        first, as `_attend_received`)."""
        _, da, (valid, j, i) = cot
        p = self.plan.stages
        order = jnp.argsort(~valid, stable=True)
        out = _zeros(self.shapes.qkv, (valid.shape[0],))
        for t in range(valid.shape[0]):
            n = order[t]
            qkv = tuple(buf[j[n], i[n] // p] for buf in kept_qkv)
            grads = jax.lax.cond(
                valid[n],
                lambda: jax.vjp(lambda *x: self.parts.attend(*x, self._aux(j[n])), *qkv)[1](
                    da[n]),
                lambda: _zeros(self.shapes.qkv))
            out = tuple(o.at[n].set(g) for o, g in zip(out, grads))
        return out

    def _p_backward_slot(self, state, row, slot, dqkv, dy):
        """This stage's P op backward for a wave slot: gradients added, and the message
        (cotangents of the residual and the attention output, (real, microbatch, layer))
        for layer i-1's A op."""
        p = self.plan.stages
        op = self._slot(row, slot)
        j, i, on, kind, k, k_out = op
        r_in, a_in = (buf[j, k] for buf in state["kept_in"])
        out = self._p_backward(state, op, r_in, a_in, dqkv, dy)
        g_in_k, g_out_k, g_head, dr, da, dx, loss, aux = out
        add = lambda acc, g, i: jax.tree.map(  # noqa: E731
            lambda A, G: A.at[i].add(G.astype(A.dtype)), acc, g)
        k_in = jnp.clip(k, 0, self.plan.layers // p - 1)
        state = {**state, "g_in": add(state["g_in"], g_in_k, k_in),
                 "g_out": add(state["g_out"], g_out_k, k_out), "g_head": g_head,
                 "dx": _put(state["dx"], (j,), dx, on & (kind == FIRST)),
                 "loss": _put(state["loss"], (j,), loss, on & (kind == LAST)),
                 "aux": jax.tree.map(lambda buf, v: _put(buf, (j,), v, on & (kind == LAST)),
                                     state["aux"], aux)}
        return state, (dr, da, (on & (i > 0), j, i - 1))

    def _p_backward(self, state, op: "_Op", r_in, a_in, dqkv, dy):
        """(w_in grads, w_out grads, head grads, dr, da, dx, loss, head aux) of one P op."""
        j, kind = op.j, op.kind
        w_in, w_out = self._weights(op.k, op.k_out)
        aux, head_in = self._aux(j), jax.tree.map(lambda a: a[j], self.head_in_M)
        none = (_zeros(self.shapes.loss), _zeros(self.shapes.aux))
        g_head = state["g_head"]

        def idle():
            return (_f32_zeros(w_in), _f32_zeros(w_out), g_head, jnp.zeros_like(r_in),
                    jnp.zeros_like(a_in), jnp.zeros_like(r_in), *none)

        def first():
            _, pull = jax.vjp(lambda w, x: (self.parts.pre(w, x, aux), x), w_in, r_in)
            g_w, dx = pull((dqkv, dy))
            return (g_w, _f32_zeros(w_out), g_head, jnp.zeros_like(r_in),
                    jnp.zeros_like(a_in), dx, *none)

        def mid():
            _, pull = jax.vjp(lambda wi, wo, r, a: self._pre_post(wi, wo, r, a, aux),
                              w_in, w_out, r_in, a_in)
            g_in, g_out, dr, da = pull((dqkv, dy))
            return g_in, g_out, g_head, dr, da, jnp.zeros_like(r_in), *none

        def last():
            whole = replicated if self.replicate_heads else (lambda tree: tree)

            def head(wo, hp, r, a):
                return self.parts.head(hp, whole(self.parts.post(wo, r, a, aux)),
                                       whole(head_in))

            loss, pull, head_aux = jax.vjp(head, w_out, self.hp, r_in, a_in, has_aux=True)
            g_out, g_hp, dr, da = pull(jnp.ones_like(loss))
            g_head_new = jax.tree.map(lambda A, G: A + G.astype(A.dtype), g_head, g_hp)
            return (_f32_zeros(w_in), g_out, g_head_new, dr, da, jnp.zeros_like(r_in), loss,
                    head_aux)

        return jax.lax.switch(kind, [idle, first, mid, last])
