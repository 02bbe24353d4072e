"""What a stage program keeps of each layer's forward for that layer's backward.

A stage's F runs its chunk's layers and keeps, per layer, what `Keep.forward` returns; the
chunk's X (the fused backward), or B and then W (the zero-bubble split), read it back from the
stage's buffers. Two ways, picked by `train.remat` (`keep_for`):

- `InputKeep` (`full`, `offload`): the layer's input alone. X recomputes the layer from it;
  B and W split the backward as `sharding.pipeline.split_backward` says
  (sharding/split_backward.py). One activation a layer, the recomputation paid in the
  backward.
- `ResidualKeep` (`none`, `minimal`): what the layer's vjp reads, as its remat policy leaves it:
  everything under `none`, the matrix products' outputs and the input under `minimal`. X, B
  and W run the vjp on it without recomputing the forward; B keeps the layer's output
  cotangent for W (the stash), and the residuals stay until W, as the zero-bubble paper
  counts a split schedule's memory. The residuals that depend only on the weights and the
  microbatch's positions (compute-dtype copies of the weights, a rotary table, a mask) are not
  kept: each backward makes them again, from a forward on a zero input whose other outputs
  the compiler drops.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from sharding.split_backward import make_split, trained_part

INPUT_KEEPING = ("full", "offload")        # train.remat values whose stages keep the input


@dataclasses.dataclass(frozen=True)
class InputKeep:
    """Keeps each layer's input; the backward recomputes the layer (`split`: the B/W split of
    a table that has one, else None)."""

    layer_fn: Callable
    x: jax.ShapeDtypeStruct
    split: object = None
    trained: frozenset | None = None

    def shapes(self) -> tuple:
        return (self.x,)

    def forward(self, w, x, aux):
        return self.layer_fn(w, x, aux), (x,)

    def backward(self, w, kept, aux, g):
        """(the weights' cotangents, the input's) for the output cotangent g."""
        return _pullback(self.layer_fn, w, kept[0], aux, self.trained)[1](g)

    def input_grad(self, w, kept, aux, g):
        return self.split.input_grad(w, kept[0], aux, g)

    def weight_grads(self, w, kept, aux, stash):
        return self.split.weight_grads(w, kept[0], aux, stash)

    def stash_shapes(self) -> tuple:
        return self.split.stash_shapes()


@dataclasses.dataclass(frozen=True)
class ResidualKeep:
    """Keeps the layer's vjp residuals that depend on its input (`kept[i]` says which of the
    pullback's leaves); the backward runs the vjp on them."""

    layer_fn: Callable
    x: jax.ShapeDtypeStruct
    kept: tuple[bool, ...]
    kept_shapes: tuple
    trained: frozenset | None = None

    def shapes(self) -> tuple:
        return self.kept_shapes

    def forward(self, w, x, aux):
        y, pull = _pullback(self.layer_fn, w, x, aux, self.trained)
        leaves = jax.tree.leaves(pull)
        return y, tuple(leaf for leaf, keep in zip(leaves, self.kept) if keep)

    def _pull(self, w, kept, aux):
        """The layer's pullback with `kept` in place, the rest made again from the weights."""
        _, pull = _pullback(self.layer_fn, w, jnp.zeros(self.x.shape, self.x.dtype), aux,
                            self.trained)
        leaves, tree = jax.tree.flatten(pull)
        stored = iter(kept)
        return jax.tree.unflatten(tree, [next(stored) if keep else leaf
                                         for leaf, keep in zip(leaves, self.kept)])

    def backward(self, w, kept, aux, g):
        return self._pull(w, kept, aux)(g)

    def input_grad(self, w, kept, aux, g):
        return self._pull(w, kept, aux)(g)[1], (g,)

    def weight_grads(self, w, kept, aux, stash):
        return self._pull(w, kept, aux)(stash[0])[0]

    def stash_shapes(self) -> tuple:
        return (self.x,)


def _pullback(layer_fn, w, x, aux, trained):
    """(the layer's output, its vjp w.r.t. the trained weights and the input)."""
    t, frozen = trained_part(w, trained)
    return jax.vjp(lambda t_, x_: layer_fn({**frozen, **t_}, x_, aux), t, x)


def residual_keep(layer_fn: Callable, w, x, aux,
                  trained: frozenset | None = None) -> ResidualKeep:
    """The `ResidualKeep` of `layer_fn` for one layer's weights `w`, input `x` and extras `aux`
    (shapes): which of its pullback's leaves depend on the input, found on the traced
    forward."""
    def leaves(w_, x_, aux_):
        return jax.tree.leaves(_pullback(layer_fn, w_, x_, aux_, trained)[1])

    closed = jax.make_jaxpr(leaves)(w, x, aux)
    n_w = len(jax.tree.leaves(w))
    depends = _depends_on(closed.jaxpr, {n_w})        # the input is the argument after w's
    shapes = tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
                   for v, d in zip(closed.jaxpr.outvars, depends) if d)
    return ResidualKeep(layer_fn, x, tuple(depends), shapes, trained)


def _depends_on(jaxpr, inputs: set[int]) -> list[bool]:
    """For each output of `jaxpr`, whether it depends on the inputs numbered `inputs` (an
    equation's outputs depend on all its inputs: calls are not looked into)."""
    reached = {v for i, v in enumerate(jaxpr.invars) if i in inputs}
    for eqn in jaxpr.eqns:
        if any(not isinstance(a, jcore.Literal) and a in reached for a in eqn.invars):
            reached.update(eqn.outvars)
    return [not isinstance(v, jcore.Literal) and v in reached for v in jaxpr.outvars]


def keep_for(remat: str, layer_fn: Callable, w, x, aux, trained: frozenset | None,
             split_how: str | None) -> InputKeep | ResidualKeep:
    """What a stage keeps under `train.remat=remat` (`layer_fn` runs one layer under that
    policy; w, x, aux: one layer's shapes). `split_how`: the B/W split a table that has one
    uses when it keeps inputs (None: the table has none)."""
    if remat in INPUT_KEEPING:
        split = None if split_how is None else make_split(split_how, layer_fn, w, x, aux, trained)
        return InputKeep(layer_fn, x, split, trained)
    return residual_keep(layer_fn, w, x, aux, trained)


def kept_bytes(keep: InputKeep | ResidualKeep) -> int:
    """Bytes one layer keeps for one microbatch from its F to its backward."""
    return sum(math.prod(s.shape) * np.dtype(s.dtype).itemsize for s in keep.shapes())
