"""Zero-bubble's backward split: B computes a layer's input gradient, W its weight gradients,
and W recomputes nothing B computed.

`split_backward(layer_fn, ...)` traces one layer's backward (the forward recomputed from the
layer's input, then its vjp) once, to a flat list of equations (calls such as `jit` and
`checkpoint` inlined). B is every equation the input gradient needs. W is every equation the
weight gradients need that B does not run; what W reads of B's values (each weight's
matrix-product input and output cotangent, a norm scale's normalised input and cotangent, the
layer's output cotangent) B hands over as the *stash*, kept from B to W. W then costs the
weight-gradient products and little else, and B + W costs what the fused backward (X) does:
the papers' split (Qi et al., "Zero Bubble Pipeline Parallelism", section 2), for any layer
function, with no hand-written backward.

The price is memory: the stash holds several activations of the layer's width and the MLP's
(`stash_bytes`; 21 layer inputs for a Llama-shaped layer with a 4x MLP) from B until W,
where F keeps the layer's input alone (full remat). `RecomputingSplit` is the other choice
(`sharding.pipeline.split_backward=recompute`): B keeps only the layer's output cotangent,
and W recomputes the layer's forward and the backward to its weights from it, about 1.5x the
fused backward's work for one activation of stash.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import numpy as np
from jax.extend import core as jcore

# Call-like primitives whose body is inlined, so that B and W can each take only the parts of
# it they need (a `jit`'s transposed matrix product computes both operands' cotangents).
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr",
          "core_call": "call_jaxpr", "checkpoint": "jaxpr", "remat2": "jaxpr",
          "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
          "custom_vjp_call_jaxpr": "fun_jaxpr"}


@dataclasses.dataclass(frozen=True)
class _Lit:
    """A constant operand (a jaxpr literal or a closed-over constant)."""
    val: object


@dataclasses.dataclass(frozen=True, eq=False)
class _Node:
    primitive: object
    params: dict
    ins: tuple          # value keys (int) or _Lit
    outs: tuple         # value keys
    ctx: object         # the equation's context (its `manager` is entered to bind it)


class _Program:
    """A jaxpr flattened into nodes over integer value keys, calls inlined."""

    def __init__(self):
        self.nodes: list[_Node] = []
        self.avals: dict[int, object] = {}

    def new_key(self, aval) -> int:
        key = len(self.avals)
        self.avals[key] = aval
        return key

    def inline(self, jaxpr, consts, in_atoms) -> list:
        env = {}
        for v, c in zip(jaxpr.constvars, consts):
            env[v] = _Lit(c)
        for v, a in zip(jaxpr.invars, in_atoms):
            env[v] = a
        read = lambda a: _Lit(a.val) if isinstance(a, jcore.Literal) else env[a]  # noqa: E731
        for eqn in jaxpr.eqns:
            ins = [read(a) for a in eqn.invars]
            body = _callee(eqn)
            if body is not None:
                outs = self.inline(*body, ins)
            else:
                outs = [self.new_key(v.aval) for v in eqn.outvars]
                self.nodes.append(_Node(eqn.primitive, eqn.params, tuple(ins), tuple(outs),
                                        eqn.ctx))
            for v, o in zip(eqn.outvars, outs):
                if not isinstance(v, jcore.DropVar):
                    env[v] = o
        return [read(a) for a in jaxpr.outvars]


def _callee(eqn):
    """(jaxpr, consts) of a call-like equation's body, or None."""
    name = _CALLS.get(eqn.primitive.name)
    if name is None or name not in eqn.params:
        return None
    body = eqn.params[name]
    if isinstance(body, jcore.ClosedJaxpr):
        return body.jaxpr, body.consts
    if isinstance(body, jcore.Jaxpr) and not body.constvars:
        return body, ()
    return None


def _run(nodes, env: dict):
    """Binds `nodes` in order; `env` maps value keys to arrays and is filled in."""
    read = lambda a: a.val if isinstance(a, _Lit) else env[a]  # noqa: E731
    for node in nodes:
        with node.ctx.manager:
            out = node.primitive.bind(*map(read, node.ins),
                                      **node.primitive.get_bind_params(node.params))
        for k, v in zip(node.outs, out if node.primitive.multiple_results else (out,)):
            env[k] = v
    return read


def _needed(nodes, wanted, stop=frozenset()) -> tuple[list, set]:
    """The nodes that compute `wanted` (keys), not looking past the keys in `stop`; and every
    key they read."""
    reads = {k for k in wanted if not isinstance(k, _Lit)}
    need = reads - stop
    keep = []
    for node in reversed(nodes):
        if need.intersection(node.outs):
            keep.append(node)
            ins = {k for k in node.ins if not isinstance(k, _Lit)}
            reads |= ins
            need |= ins - stop
    keep.reverse()
    return keep, reads


@dataclasses.dataclass(frozen=True)
class SplitBackward:
    """One layer's backward as B (`input_grad`) and W (`weight_grads`). Built by
    `split_backward`; call both with arrays shaped as the ones it was traced with."""

    program: _Program
    w_tree: object
    in_keys: tuple            # keys of (w leaves, x, aux leaves, g), flattened
    dx: tuple                 # keys (or _Lit) of x's cotangent
    dw: tuple                 # keys (or _Lit) of the weights' cotangents, w's leaf order
    b_nodes: tuple
    w_nodes: tuple
    stash: tuple              # keys B hands to W

    def _env(self, w, x, aux, g):
        leaves = jax.tree.leaves((w, x, aux, g))
        return dict(zip(self.in_keys, leaves))

    def input_grad(self, w, x, aux, g):
        """(x's cotangent, the stash: a tuple of arrays)."""
        read = _run(self.b_nodes, self._env(w, x, aux, g))
        return read(self.dx[0]), tuple(read(k) for k in self.stash)

    def weight_grads(self, w, x, aux, stash):
        """The weights' cotangents (w's tree) from B's stash; the output cotangent is not
        read (the stash holds what W needs of it)."""
        env = self._env(w, x, aux, x)
        for k in self.in_keys[-1:]:
            env.pop(k)                       # g: W reads it from the stash, if at all
        env.update(zip(self.stash, stash))
        read = _run(self.w_nodes, env)
        return jax.tree.unflatten(self.w_tree, [read(k) for k in self.dw])

    def stash_shapes(self) -> tuple:
        return tuple(jax.ShapeDtypeStruct(self.program.avals[k].shape,
                                          self.program.avals[k].dtype) for k in self.stash)

    def stash_bytes(self) -> int:
        return sum(math.prod(s.shape) * np.dtype(s.dtype).itemsize for s in self.stash_shapes())


@dataclasses.dataclass(frozen=True)
class RecomputingSplit:
    """B keeps only the layer's output cotangent; W recomputes the layer from its input and
    pulls the cotangent back to the weights. Same interface as `SplitBackward`."""

    layer_fn: Callable
    g: jax.ShapeDtypeStruct
    trained: frozenset | None = None    # the weights W differentiates (None: every one)

    def input_grad(self, w, x, aux, g):
        return jax.vjp(lambda x_: self.layer_fn(w, x_, aux), x)[1](g)[0], (g,)

    def weight_grads(self, w, x, aux, stash):
        t, frozen = trained_part(w, self.trained)
        return jax.vjp(lambda t_: self.layer_fn({**frozen, **t_}, x, aux), t)[1](stash[0])[0]

    def stash_shapes(self) -> tuple:
        return (jax.ShapeDtypeStruct(self.g.shape, self.g.dtype),)

    def stash_bytes(self) -> int:
        return math.prod(self.g.shape) * np.dtype(self.g.dtype).itemsize


SPLITS = ("stash", "recompute")


def trained_part(w: dict, trained: frozenset | None) -> tuple[dict, dict]:
    """(the weights of one layer's `w` that get gradients, the others): `trained` names the
    first (LoRA's adapters); None, every weight."""
    if trained is None:
        return w, {}
    return ({k: v for k, v in w.items() if k in trained},
            {k: v for k, v in w.items() if k not in trained})


def make_split(how: str, layer_fn: Callable, w, x, aux,
               trained: frozenset | None = None) -> SplitBackward | RecomputingSplit:
    """The backward split `sharding.pipeline.split_backward=how` picks (see the docstring).
    With `trained` (only some weights get gradients: LoRA) W recomputes whatever `how` says:
    the stashed split forms every weight's product."""
    if how == "recompute" or trained is not None:
        return RecomputingSplit(layer_fn, jax.ShapeDtypeStruct(x.shape, x.dtype), trained)
    if how != "stash":
        raise ValueError(f"sharding.pipeline.split_backward={how!r} is not one of "
                         f"{', '.join(SPLITS)}")
    return split_backward(layer_fn, w, x, aux)


def split_backward(layer_fn: Callable, w, x, aux) -> SplitBackward:
    """Splits `layer_fn(w, x, aux) -> y` (y shaped as x)'s backward into B and W. `w`, `x` and
    `aux` are arrays or `jax.ShapeDtypeStruct`s of one layer's weights, input and extra
    inputs (aux is not differentiated). `layer_fn` must run one layer without a loop: a
    `scan`'s backward computes both gradients in one equation, which cannot be split."""
    def backward(w, x, aux, g):
        dw, dx = jax.vjp(lambda w_, x_: layer_fn(w_, x_, aux), w, x)[1](g)
        return dx, dw

    closed = jax.make_jaxpr(backward)(w, x, aux, x)
    prog = _Program()
    in_keys = tuple(prog.new_key(v.aval) for v in closed.jaxpr.invars)
    outs = prog.inline(closed.jaxpr, closed.consts, in_keys)
    dx, dw = tuple(outs[:1]), tuple(outs[1:])
    b_nodes, _ = _needed(prog.nodes, dx)
    # The weights, the layer's input and the aux inputs stay at hand until W (the stage keeps
    # them); the output cotangent does not, so W reads it from the stash like B's values.
    b_values = {k for node in b_nodes for k in node.outs} | {in_keys[-1]}
    if b_values.intersection(dw):
        raise ValueError("split_backward: the input gradient's equations also compute a weight "
                         "gradient (a loop over layers?); pass a function of one layer")
    while True:
        w_nodes, w_reads = _needed([n for n in prog.nodes if n not in b_nodes], dw,
                                   stop=b_values)
        stash = w_reads & b_values
        hoist = next((n for n in w_nodes if _hoisting_saves(n, w_nodes, stash, b_values,
                                                            prog.avals)), None)
        if hoist is None:
            break
        b_nodes.append(hoist)          # its inputs are B's values: B can run it last
        b_values |= set(hoist.outs)
    return SplitBackward(prog, jax.tree.structure(w), in_keys, dx, dw, tuple(b_nodes),
                         tuple(w_nodes), tuple(sorted(stash)))


def _bytes(aval) -> int:
    return math.prod(aval.shape) * np.dtype(aval.dtype).itemsize


def _hoisting_saves(node, w_nodes, stash, b_values, avals) -> bool:
    """Whether B should run W's elementwise `node` and stash its output instead of its
    inputs: it can (its inputs are B's values), and the stash shrinks (e.g. SwiGLU's product,
    which only the down projection's weight gradient reads, instead of both its factors). Only
    elementwise nodes move, so B never computes a weight gradient."""
    ins = {k for k in node.ins if not isinstance(k, _Lit)}
    if not ins <= b_values:
        return False
    shapes = {avals[k].shape for k in (*ins, *node.outs) if avals[k].shape != ()}
    if len(shapes) != 1:
        return False
    read_elsewhere = {k for n in w_nodes if n is not node for k in n.ins
                      if not isinstance(k, _Lit)}
    freed = sum(_bytes(avals[k]) for k in ins & stash - read_elsewhere)
    return sum(_bytes(avals[k]) for k in node.outs) < freed
