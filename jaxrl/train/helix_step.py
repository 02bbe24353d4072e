"""The train step's loss and gradients by HelixPipe (sharding/helix.py): the model's layers cut
around their attention, laid out on the stages, and run by sharding/helix_program.py.

Stage s holds the input side (norm, q/k/v projections) of layers s, s+P, ... and the output
side (output projection, MLP) of layers s-1, s-1+P, ... . The trainer keeps the layer stack in
HelixPipe's pipeline order (sharding/layer_order.py: stage s's block is layers s, s+P, ...), so
the input sides are laid out by a reshape and the output sides by one shift of a stage.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxrl.models.layer_parts import INPUT_KEYS, attend, attention_inputs, \
    attention_output_and_mlp
from jaxrl.models.transformer import layer_inputs
from jaxrl.train.pipeline_io import pipeline_io
from sharding.helix_program import HelixInputs, LayerParts, run_helix


def helix_layout(stacked: dict, stages: int, pipeline_order: bool) -> tuple[dict, dict]:
    """[L, ...] layer parameters -> (input sides, output sides), each [P, L/P, ...]: stage s,
    slot k holds layer s + kP's input side and layer s + kP - 1's output side (stage 0, slot
    0: layer L-1's, which boundary L runs before the head)."""
    view = lambda a: _stage_view(a, stages, pipeline_order)  # noqa: E731
    w_in = {k: view(v) for k, v in stacked.items() if k in INPUT_KEYS}
    w_out = {k: _shift_out(view(v)) for k, v in stacked.items() if k not in INPUT_KEYS}
    return w_in, w_out


def from_helix_layout(g_in: dict, g_out: dict, pipeline_order: bool) -> dict:
    """Inverse of `helix_layout`: one [L, ...] tree."""
    flat = lambda a: _flat_view(a, pipeline_order)  # noqa: E731
    return {**{k: flat(v) for k, v in g_in.items()},
            **{k: flat(_unshift_out(v)) for k, v in g_out.items()}}


def _stage_view(a, p: int, pipeline_order: bool):
    if pipeline_order:                       # stored as stage 0's layers, stage 1's, ...
        return a.reshape(p, a.shape[0] // p, *a.shape[1:])
    return jnp.swapaxes(a.reshape(a.shape[0] // p, p, *a.shape[1:]), 0, 1)


def _flat_view(a, pipeline_order: bool):
    if pipeline_order:
        return a.reshape(-1, *a.shape[2:])
    return jnp.swapaxes(a, 0, 1).reshape(-1, *a.shape[2:])


def _shift_out(a_PV):
    """Layer s + kP's block moved to stage s+1 (stage 0 takes stage P-1's, one slot on)."""
    a_PV = jnp.roll(a_PV, 1, axis=0)
    return a_PV.at[0].set(jnp.roll(a_PV[0], 1, axis=0))


def _unshift_out(a_PV):
    a_PV = a_PV.at[0].set(jnp.roll(a_PV[0], -1, axis=0))
    return jnp.roll(a_PV, -1, axis=0)


def layer_parts(model_cfg, head) -> LayerParts:
    """The model's layer in HelixPipe's parts; `head` as `LayerParts.head`."""
    def weights(w):
        return {k: v.astype(model_cfg.compute_dtype) for k, v in w.items()}

    def tables(aux, length):
        positions, segment_ids = aux
        return layer_inputs(model_cfg, positions, segment_ids, length)(None)

    def pre(w, y, aux):
        cos, sin, _ = tables(aux, y.shape[1])
        return attention_inputs(model_cfg, weights(w), y, cos, sin)

    def attention(q, k, v, aux):
        return attend(model_cfg, q, k, v, tables(aux, q.shape[1])[2], aux[1])

    def post(w, r, a, aux):
        return attention_output_and_mlp(model_cfg, weights(w), r, a)[0]

    return LayerParts(pre, attention, post, head)


def helix_grads(graphdef, params, batch, objective, pipeline, mesh,
                pipeline_order: bool, replicate_heads: bool):
    """(loss [M], weight [M], stats [M, ...], live [M], float32 gradients) of `batch` (flat
    [B, ...] arrays) by HelixPipe: the embedding before the pipeline, the head (final norm,
    logits, objective) on boundary L, the embedding's gradient pulled back from boundary 0's
    input gradient."""
    io = pipeline_io(graphdef, params, batch, objective, pipeline.microbatches)
    w_in, w_out = helix_layout(params["layers"], pipeline.stages, pipeline_order)
    inputs = HelixInputs(w_in, w_out, io.outer, io.x_M, io.aux_M, io.batch_M, io.live_M)
    loss_M, (weight_M, stats_M), g_in, g_out, g_outer, dx = run_helix(
        pipeline.helix(io.model_cfg.num_layers), layer_parts(io.model_cfg, io.head), inputs,
        mesh, replicate_heads)
    grads = {**io.outer_grads(g_outer, dx),
             "layers": from_helix_layout(g_in, g_out, pipeline_order)}
    return loss_M, weight_M, stats_M, io.live_M, grads
