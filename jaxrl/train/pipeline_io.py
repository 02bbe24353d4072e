"""What every per-stage pipeline (the table schedules, HelixPipe) takes and gives back around
its stage programs: the embedding (`embed`, run by the table schedules' first chunk on each
microbatch's tokens when it is due; HelixPipe's inputs embedded before its program, `x_M`,
their gradient pulled back from its input gradient); the head (final norm, logits,
objective), run after the last layer; the batch split into microbatches, with those that
have nothing to learn from (RL padding) marked so that no op runs for them."""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from jaxrl.models import merge_params
from sharding import pipeline as pp


@dataclasses.dataclass(frozen=True)
class PipelineIO:
    model_cfg: object
    ids: jax.Array          # [B, T] the batch's tokens
    ids_M: jax.Array        # [M, b, T] the same, by microbatch
    embed: Callable         # (outer params, ids_bT) -> x_bTD, one microbatch's first input
    outer: dict             # every parameter but the layer stack
    x_M: jax.Array          # [M, b, T, D] the embedded microbatches (HelixPipe's inputs)
    aux_M: tuple            # ([M, b, T] positions, [M, b, T] segment ids or None)
    batch_M: dict           # the batch as [M, b, ...] arrays (the head's inputs)
    live_M: jax.Array       # [M] bool: microbatches with something to learn from
    head: Callable          # (outer params, h_bTD, microbatch) -> (loss, (weight, stats))
    micro: Callable         # [B, ...] -> [M, b, ...] (None stays None)
    _pullback: Callable

    def outer_grads(self, g_head: dict, dx_M) -> dict:
        """The outer parameters' float32 gradient: the head's plus the embedding's, pulled
        back from the pipeline's input gradient `dx_M`."""
        (g_embed,) = self._pullback(pp.from_microbatches(dx_M).astype(self.x_M.dtype))
        return jax.tree.map(lambda a, b: a + b.astype(jnp.float32), g_head, g_embed)


def pipeline_io(graphdef, params, batch, objective, microbatches: int) -> PipelineIO:
    """The inputs of a pipeline of `microbatches` over `batch` (flat [B, ...] arrays)."""
    ids = batch["input_ids"]
    positions = batch.get("positions")
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    outer = {k: v for k, v in params.items() if k != "layers"}
    layers = jax.lax.stop_gradient(params["layers"])

    def embed(o, ids_bT=ids):
        return merge_params(graphdef, {**o, "layers": layers}).embed_tokens(ids_bT)

    def head(o, h_bTD, mb):
        # The objective as usual, with the layer stack replaced by the pipeline's output.
        loss_sum, weight, stats = objective(merge_params(graphdef, {**o, "layers": layers}), mb,
                                            None, lambda *_: h_bTD)
        return loss_sum, (weight, stats)

    x_BTD, pullback = jax.vjp(embed, outer)
    micro = lambda a: None if a is None else pp.to_microbatches(a, microbatches)  # noqa: E731
    batch_M = jax.tree.map(micro, batch)
    live_M = jnp.any(batch_M["loss_mask"] > 0, axis=tuple(range(1, batch_M["loss_mask"].ndim)))
    return PipelineIO(merge_params(graphdef, params).cfg, ids, micro(ids), embed, outer,
                      micro(x_BTD),
                      (micro(positions), micro(batch.get("segment_ids"))), batch_M, live_M,
                      head, micro, pullback)
