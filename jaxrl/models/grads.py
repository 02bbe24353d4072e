"""Weight gradients contracted in the order XLA:CPU transposes least (shared by the gated MLP's
and LoRA's backward passes)."""

from __future__ import annotations

import jax.numpy as jnp


def weight_grad(a_BTI, b_BTO):
    """sum over tokens of a^T b, [I, O], contracted with the wider operand on the left."""
    a, b = a_BTI.reshape(-1, a_BTI.shape[-1]), b_BTO.reshape(-1, b_BTO.shape[-1])
    if a.shape[1] >= b.shape[1]:
        return jnp.einsum("ti,to->io", a, b)
    return jnp.einsum("to,ti->oi", b, a).T
