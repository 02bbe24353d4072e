"""The ops a stage program runs at a tick (sharding/stage_programs.py).

Each op is a `lax.switch` branch. It reads the stage's activation buffers (inbox, layer
inputs, stash) and returns only the activations it produces, as a *delta* of the same
structure for every op (zeros where an op produces nothing); `apply_delta` writes the delta
into the buffers, one slot in place, outside the switch. A branch that returned the buffers
themselves would make XLA copy every buffer it leaves unchanged (a conditional's result
cannot share its operand's memory) on every tick: with the B/W split's stash that copying was
most of a zero-bubble step (`jaxrl bench pipeline_step`, zb-h1 4.3 s -> 3.0 s on CPU).

The gradient accumulators (the stage's weights and the head's, float32) are the exception:
the ops that produce gradients add them in place inside the branch, and the other branches
pass the accumulators through. A delta would need a second, gradient-sized buffer (TPU device
temp of the demo model's 1f1b step: 4.4 MiB with one, 3.5 MiB without); the pass-through
copies measured within the runs' noise on CPU.

Ops by branch index: idle, F, B, W, X, busy (X's second tick), R (the reference model's
forward, PipeFill), then F of the last chunk with the head, R of the last chunk with the
reference head, and X and B of the first chunk with the embedding's gradient. The first
chunk's F and R embed their microbatch's tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sharding import schedules as sch
from sharding.layer_keep import InputKeep, ResidualKeep

FH = len(sch.OPS)       # branch index of F on the last chunk (forward, then the head)
RH = FH + 1             # branch index of R on the last chunk (reference forward and head)
XE = FH + 2             # X on the first chunk (backward, then the embedding's gradient)
BE = FH + 3             # B on the first chunk (input gradient, then the embedding's gradient)


@dataclasses.dataclass(frozen=True)
class StageModel:
    """What one stage's ops compute with. `head(hp, h, head_in, ref_logp)` -> (loss, head
    aux, head params' gradient, h's cotangent) for one microbatch's head inputs `head_in`;
    `embed(hp, ids_bT)` the first chunk's input from a microbatch's tokens `ids_M[j]`, shaped
    `x_spec`; `w_V` this stage's chunks [V, Lc, ...]; `aux_M` the layers' extra inputs per
    microbatch; `keep` what F keeps of each layer for its backward (sharding/layer_keep.py);
    `split`: the table splits the backward into B and W; `ref` the
    reference model's arrays on this stage (w_V, head_params) or None, with its head and
    embedding; `replicate_heads`: the heads run on whole copies of their inputs
    (`run_schedule`); `trained`: the layer weights differentiated (LoRA's adapters, and then
    neither the head's nor the embedding's), None for every one."""

    layer_fn: Callable
    head: Callable
    embed: Callable
    w_V: dict
    hp: dict
    ids_M: jax.Array
    x_spec: jax.ShapeDtypeStruct
    aux_M: object
    head_in_M: object
    keep: InputKeep | ResidualKeep | None = None
    split: bool = False
    ref: dict | None = None
    ref_head_fn: Callable | None = None
    ref_embed_fn: Callable | None = None
    embed_key: str = "embed"            # the outer parameter `embed` looks rows up in
    replicate_heads: bool = False
    trained: frozenset | None = None    # the layer weights that get gradients (None: all)

    def head_input(self, tree):
        """`tree` as a head takes it: whole on every device with `replicate_heads`."""
        return replicated(tree) if self.replicate_heads else tree

    def zero_delta(self, loss_aux_shapes, ref_shape, skip=()) -> dict:
        """The delta of an op that produces nothing: zeros of every field's shape (but the
        fields in `skip`), made where it is called (inside a branch: a fill, not a copy)."""
        mb = jnp.zeros(self.x_spec.shape, self.x_spec.dtype)
        chunk = jax.tree.map(lambda a: a[0], self.w_V)
        layers = jax.tree.leaves(chunk)[0].shape[0]
        zeros = lambda s, dt=None: jnp.zeros(s.shape, dt or s.dtype)  # noqa: E731
        delta = {
            "send": mb,
            "acts": tuple(jnp.zeros((layers, *s.shape), s.dtype) for s in self.keep.shapes()),
            "loss": zeros(loss_aux_shapes[0]), "aux": jax.tree.map(zeros, loss_aux_shapes[1]),
        }
        if self.split and "stash" not in skip:
            delta["stash"] = tuple(jnp.zeros((layers, *s.shape), s.dtype)
                                   for s in self.keep.stash_shapes())
        if ref_shape is not None:
            delta["ref_logp"] = zeros(ref_shape)

        return {k: v for k, v in delta.items() if k not in skip}


def branches(model: StageModel, shapes: tuple) -> list[Callable]:
    """The `lax.switch` branches, indexed as the module docstring says: each takes (bufs,
    grads, row), `bufs` the stage's activation buffers (read only), `grads` the accumulators
    {g_w, g_head}, and returns (grads, delta). `shapes` = (the loss's and head aux's shapes,
    the reference head's output shape or None)."""
    ops = _Ops(model)
    split, ref = model.split, model.ref is not None
    nothing = ops.nothing
    return [_complete(model, shapes, op) for op in (
        nothing, ops.forward, ops.input_grads if split else nothing,
        ops.weight_grads if split else nothing, ops.backward, nothing,
        ops.reference_forward if ref else nothing, ops.forward_head,
        ops.reference_head if ref else nothing, ops.embedded(ops.backward),
        ops.embedded(ops.input_grads) if split else nothing)]


def _take(tree, j):
    return jax.tree.map(lambda a: a[j], tree)


def _complete(model: StageModel, shapes: tuple, op: Callable) -> Callable:
    """The branch of `op`: its gradients added in place, its delta filled with zeros."""
    def run(bufs, grads, row):
        out = dict(op(bufs, row))
        grads = dict(grads)
        if "dw" in out:
            grads["g_w"] = jax.tree.map(lambda acc, g: acc.at[row["chunk"]].add(g),
                                        grads["g_w"], out.pop("dw"))
        if "g_head" in out:
            grads["g_head"] = jax.tree.map(jnp.add, grads["g_head"], out.pop("g_head"))
        if "rows" in out:
            grads["g_head"] = _add_rows(model, grads["g_head"], out.pop("rows"), row)
        return grads, {**model.zero_delta(*shapes, skip=out), **out}
    return run


class _Ops:
    """What each op computes on one stage: (bufs, row) -> the fields of its delta, and the
    gradients (dw, g_head) to add."""

    def __init__(self, model: StageModel):
        self.model = model

    def _chunk_inputs(self, row):
        return _take(self.model.w_V, row["chunk"]), _take(self.model.aux_M, row["microbatch"])

    def _input(self, bufs, row, embed, params):
        """The chunk's input: the microbatch's tokens embedded (`embed(params, ids)`) on the
        first chunk, else the message in the inbox."""
        ids = self.model.ids_M[row["microbatch"]]
        return jax.lax.cond(row["first"] == 1, lambda: embed(params, ids).astype(
            self.model.x_spec.dtype), lambda: bufs["inbox"][row["in_slot"]])

    def _run_forward(self, bufs, row):
        m = self.model
        w_c, aux = self._chunk_inputs(row)
        x = self._input(bufs, row, m.embed, m.hp)
        return jax.lax.scan(lambda h, w_l: m.keep.forward(w_l, h, aux), x, w_c)

    def embedded(self, backward):
        """`backward` on the first chunk, then the embedding's gradient from its input
        gradient (none when the outer parameters are frozen)."""
        def run(bufs, row):
            out = backward(bufs, row)
            m = self.model
            if m.trained is None:
                ids, dx = m.head_input((m.ids_M[row["microbatch"]], out["send"]))
                out["rows"] = _row_grads(m.embed, m.hp, m.embed_key, ids,
                                         dx.astype(m.x_spec.dtype))
            return out
        return run

    def nothing(self, bufs, row):
        return {}

    def forward(self, bufs, row):
        y, xs = self._run_forward(bufs, row)
        return dict(send=y, acts=xs)

    def forward_head(self, bufs, row):
        m = self.model
        y, xs = self._run_forward(bufs, row)
        j = row["microbatch"]
        ref_logp = bufs["ref_logp"][j] if "ref_logp" in bufs else None
        loss, head_aux, g_hp, g_y = m.head(m.hp, *m.head_input((y, _take(m.head_in_M, j))),
                                           ref_logp)
        return dict(send=g_y.astype(y.dtype), acts=xs, loss=loss, aux=head_aux,
                    g_head=jax.tree.map(lambda g: g.astype(jnp.float32), g_hp))

    @staticmethod
    def _kept(bufs, row):
        """What the chunk's F kept for this microbatch, per layer."""
        return tuple(buf[row["res_slot"]] for buf in bufs["acts"])

    def backward(self, bufs, row):
        """X: both gradients of the chunk, layer by layer from what F kept."""
        keep = self.model.keep
        w_c, aux = self._chunk_inputs(row)

        def layer_back(g, w_kept):
            dw, dx = keep.backward(*w_kept, aux, g)
            return dx.astype(g.dtype), dw

        g = bufs["inbox"][row["in_slot"]]
        dx, dws = jax.lax.scan(layer_back, g, (w_c, self._kept(bufs, row)), reverse=True)
        return dict(send=dx, dw=_f32(dws))

    def input_grads(self, bufs, row):
        """B: the chunk's input gradient, and each layer's stash (what its W reads)."""
        keep = self.model.keep
        w_c, aux = self._chunk_inputs(row)

        def layer_b(g, w_kept):
            dx, stash = keep.input_grad(*w_kept, aux, g)
            return dx.astype(g.dtype), stash

        g = bufs["inbox"][row["in_slot"]]
        dx, stash = jax.lax.scan(layer_b, g, (w_c, self._kept(bufs, row)), reverse=True)
        return dict(send=dx, stash=stash)

    def weight_grads(self, bufs, row):
        """W: the chunk's weight gradients from what F kept and B stashed."""
        keep = self.model.keep
        w_c, aux = self._chunk_inputs(row)
        stash = tuple(buf[row["w_slot"]] for buf in bufs["stash"])
        _, dws = jax.lax.scan(
            lambda _, w_k_s: (None, keep.weight_grads(*w_k_s[:2], aux, w_k_s[2])),
            None, (w_c, self._kept(bufs, row), stash))
        return dict(dw=_f32(dws))

    def _run_reference(self, row, bufs):
        m = self.model
        c, j = row["chunk"], row["microbatch"]
        x = self._input(bufs, row, m.ref_embed_fn, m.ref["head_params"])
        aux = _take(m.aux_M, j)
        return jax.lax.scan(lambda h, w_l: (m.layer_fn(w_l, h, aux), None), x,
                            _take(m.ref["w_V"], c))[0]

    def reference_forward(self, bufs, row):
        return dict(send=self._run_reference(row, bufs))

    def reference_head(self, bufs, row):
        m = self.model
        y = self._run_reference(row, bufs)
        out = m.ref_head_fn(m.ref["head_params"],
                            *m.head_input((y, _take(m.head_in_M, row["microbatch"]))))
        return dict(ref_logp=out)


def _row_grads(embed, hp, key: str, ids, dx):
    """The gradient of the embedding table `hp[key]`'s rows `ids` ([b, T, D] float32) from
    the cotangent `dx` of `embed(hp, ids)`, where `embed` looks the rows up and transforms
    each (a cast, a scale). Only those rows: the table-sized gradient is never formed."""
    rows = jnp.take(hp[key], ids, axis=0)
    where = jnp.arange(ids.size, dtype=ids.dtype).reshape(ids.shape)
    _, pull = jax.vjp(lambda r: embed({**hp, key: r.reshape(-1, r.shape[-1])}, where), rows)
    return pull(dx)[0].astype(jnp.float32)


def _f32(tree):
    return jax.tree.map(lambda g: g.astype(jnp.float32), tree)


def _add_rows(model: StageModel, g_head: dict, rows, row) -> dict:
    """The embedding's gradient from a first chunk's backward (`rows`: the microbatch's rows'
    gradients) added to the table's accumulator in place, on whole copies beside fsdp and
    tensor (`head_input`). Inside the branch: out of it, every tick's delta carries a
    float32 microbatch of rows (256 MiB at 32k tokens) for the same device temp elsewhere."""
    key, ids = model.embed_key, model.ids_M[row["microbatch"]]
    ids, rows = model.head_input((ids, rows))
    return {**g_head, key: g_head[key].at[ids].add(rows)}


def apply_delta(state: dict, d: dict, op, row) -> dict:
    """Writes a tick's delta into the stage's buffers (all but the inbox, which the sent
    message reaches by `ppermute`, and the gradients, which the branch added): each write
    touches one slot, or one microbatch's entry, and keeps its old value unless `op`
    produced it."""
    j = row["microbatch"]

    def put(buf, index, new, when):
        return buf.at[index].set(jnp.where(when, new, buf[index]))

    state = dict(state)
    forward = (op == sch.F) | (op == FH)
    state["acts"] = tuple(put(buf, row["res_slot"], new, forward)
                          for buf, new in zip(state["acts"], d["acts"]))
    if "stash" in state:
        state["stash"] = tuple(put(buf, row["w_slot"], new, (op == sch.B) | (op == BE))
                               for buf, new in zip(state["stash"], d["stash"]))
    head = op == FH
    state["loss"] = put(state["loss"], j, d["loss"], head)
    state["aux"] = jax.tree.map(lambda buf, a: put(buf, j, a, head), state["aux"], d["aux"])
    if "ref_logp" in state:
        state["ref_logp"] = put(state["ref_logp"], j, d["ref_logp"], op == RH)
    return state


def replicated(tree):
    """`tree` gathered whole on every device of the automatic (non-stage) axes."""
    return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, P()), tree)
