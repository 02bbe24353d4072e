"""The order of the stacked layer axis in a train state: canonical (layer 0 first: checkpoints,
weight pushes, evaluation, Hugging Face export) or pipeline order (the trainer's state under a
schedule that gives a stage layers that are not one contiguous block).

The layer axis is sharded over the mesh's `stage` axis in contiguous blocks: stage s holds
layers s*L/P .. (s+1)*L/P - 1. A circular pipeline with v repeats, an interleaved one, and the V
schedules give stage s other layers (circular: blocks s, s+P, ...; V: chunks s and 2P-1-s), so
a canonical stack would be gathered across stages at every step just to be laid out, and the
gradients scattered back. In pipeline order the stack is permuted once, when the state is made
or restored, so that each stage's block is exactly the layers it runs, in the order it runs
them: laying it out is a reshape, and no weight crosses a stage during a step.

`LayerOrder.for_pipeline(pipeline, num_layers)` is None when the canonical order is already the
pipeline's (gpipe, 1f1b, zb-h1, one repeat). A state, parameter or gradient tree is converted
with `to_pipeline` / `to_canonical`: every leaf under a `layers` key (parameters and the
optimizer's moments alike) is permuted along its first axis.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from sharding import pipeline as pp
from sharding import stage_programs


@dataclasses.dataclass(frozen=True)
class LayerOrder:
    """`permutation[i]` is the canonical index of the layer stored at position i."""

    permutation: tuple[int, ...]

    @classmethod
    def for_pipeline(cls, pipeline: pp.PipelineConfig | None,
                     num_layers: int) -> "LayerOrder | None":
        if pipeline is None or not pipeline.enabled:
            return None
        index = {"layers": np.arange(num_layers)}
        if pipeline.table is not None:
            stored = stage_programs.to_stage_chunks(index, pipeline.table)["layers"]
        elif pipeline.schedule == "circular":
            stored = pp.to_stages(index, pipeline.stages, pipeline.repeats)["layers"]
        elif pipeline.schedule == "helix":       # stage s: layers s, s+P, ... (sharding/helix.py)
            stored = pp.to_stages(index, pipeline.stages,
                                  num_layers // pipeline.stages)["layers"]
        else:
            return None
        stored = np.asarray(stored).reshape(-1)
        if (stored == np.arange(num_layers)).all():
            return None
        return cls(tuple(int(i) for i in stored))

    def to_pipeline(self, tree: Any) -> Any:
        return _permute_layers(tree, np.asarray(self.permutation))

    def to_canonical(self, tree: Any) -> Any:
        return _permute_layers(tree, np.argsort(self.permutation))


def _permute_layers(tree: Any, index: np.ndarray) -> Any:
    def permute(path, leaf):
        if any(getattr(k, "key", None) == "layers" for k in path):
            return leaf[index]
        return leaf
    return jax.tree_util.tree_map_with_path(permute, tree)


def converter(order: LayerOrder | None, to: str, shardings=None, on_device=None):
    """A jitted function converting a tree (a train state, or parameters) to `to` order
    ("pipeline" or "canonical"), placed in `shardings`; the identity when `order` is None.
    `on_device`: device shardings of a host-resident optimizer state, brought to the device to
    be permuted (the output goes back to `shardings`)."""
    if order is None:
        return lambda tree: tree
    permute = order.to_pipeline if to == "pipeline" else order.to_canonical

    def convert(tree):
        if on_device is not None and isinstance(tree, dict) and "opt_state" in tree:
            tree = {**tree, "opt_state": jax.device_put(tree["opt_state"], on_device)}
        return permute(tree)
    return jax.jit(convert, out_shardings=shardings)
