"""Activation rematerialisation and host offload for the layer scan (`train.remat`).

- none:    keep every activation the backward pass needs (fastest, most memory).
- full:    keep only each layer's input; recompute the layer in the backward pass.
- minimal: keep the matrix-product outputs, recompute the cheap elementwise work around them.
- offload: move the named activations (q/k/v projections, attention output, MLP input) to
           pinned host memory after the forward pass and bring them back for the backward one
           (MaxText's offload policy; PipeOffload's idea applied per layer), recompute the rest.

The model tags those activations with `jax.ad_checkpoint.checkpoint_name`; a policy picks
which tagged values are saved, offloaded or recomputed. Only sharding/ decides this.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax

from jaxrl.models.transformer import apply_layer, decoder_layer, run_layers

REMAT_POLICIES = ("none", "full", "minimal", "offload")
# Names the model gives its activations (jaxrl/models/transformer.py decoder_layer).
OFFLOADED = ("query_proj", "key_proj", "value_proj", "attention_out", "mlp_in")


def remat_policy(name: str):
    """The `jax.checkpoint` policy of `train.remat=name` (None for `none`)."""
    if name not in REMAT_POLICIES:
        raise ValueError(f"train.remat={name!r} is not a remat policy; choose one of "
                         f"{', '.join(REMAT_POLICIES)}")
    cp = jax.checkpoint_policies
    return {"none": None,
            "full": cp.nothing_saveable,
            "minimal": cp.dots_with_no_batch_dims_saveable,
            "offload": cp.save_and_offload_only_these_names(
                names_which_can_be_saved=(), names_which_can_be_offloaded=OFFLOADED,
                offload_src="device", offload_dst="pinned_host")}[name]


def remat_layer(layer_fn: Callable, name: str) -> Callable:
    """`layer_fn(cfg, params, x, ...)` wrapped in the policy (unchanged for `none`)."""
    policy = remat_policy(name)
    if policy is None:
        return layer_fn
    return jax.checkpoint(layer_fn, policy=policy, static_argnums=(0,))


def layer_stack(name: str) -> Callable:
    """A model `stack_fn` (`run_layers` signature) whose every layer runs under policy `name`."""
    return functools.partial(run_layers, layer_fn=remat_layer(decoder_layer, name))


def single_layer(name: str) -> Callable:
    """`fn(cfg, params, x, positions, segment_ids=None)`: one layer (no `layers` axis, no
    loop) under policy `name`, as the pipeline's stage programs run it."""
    return functools.partial(apply_layer, layer_fn=remat_layer(decoder_layer, name))
