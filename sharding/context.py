"""Context parallelism's batch layout: every per-token array of a train batch put in the
load-balanced order that jaxrl/models/context_attention.py attends over, with its sequence
dimension split over the `context` mesh axis.

A batch here is the train step's `[M, B/M, T, ...]` arrays. Each is permuted along T by the
same static index (`stored_index`); the loss and every metric are sums, minima and maxima over
tokens, so they do not change with the order. Positions are made explicit first (RoPE reads
them), so a token keeps its own wherever it is stored.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl.models.context_attention import AXIS, context_size, stored_index
from sharding import mesh as shd


def to_context_order(batch: dict, mesh: Mesh, rules=shd.RULES) -> dict:
    """`batch` ([M, B/M, T, ...] arrays) in the load-balanced order, T split over `context`;
    unchanged on a mesh without a context axis."""
    c = context_size(mesh)
    if c == 1:
        return batch
    m, rows, t = batch["input_ids"].shape
    if "positions" not in batch:
        batch = {**batch, "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32),
                                                        (m, rows, t))}
    index = jnp.asarray(stored_index(t, c))
    batch_axes = tuple(a for a in rules["batch"] if mesh.shape[a] > 1) or None

    def reorder(x):
        if x.ndim < 3 or x.shape[2] != t:
            return x
        spec = P(None, batch_axes, AXIS, *(None,) * (x.ndim - 3))
        return jax.lax.with_sharding_constraint(jnp.take(x, index, axis=2),
                                                NamedSharding(mesh, spec))

    return jax.tree.map(reorder, batch)
