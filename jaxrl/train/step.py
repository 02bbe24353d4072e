"""The jitted, sharded train step: masked token loss, gradient accumulation, AdamW.

A train state is a plain dict `{params, opt_state, step, rng}` of arrays, placed on the mesh by
`init_state` / `state_shardings` and updated in place (donated) by the step.

Batches are dicts of `[M, B/M, T]` arrays (M microbatches): `input_ids`, `targets` and
`loss_mask` (1.0 where the target token counts). The loss is the mean over all counted tokens of
the whole global batch, so the accumulated gradient equals the one-shot gradient exactly.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from jaxrl.models import ModelConfig, Transformer, abstract_model, merge_params, param_axes
from jaxrl.models.transformer import decoder_layer, split_params
from jaxrl.train.objectives import SupervisedLoss
from sharding import mesh as shd
from sharding.offload import remat_layer


def _combine(name: str, a, b):
    if name.endswith("_min"):
        return jnp.minimum(a, b)
    if name.endswith("_max"):
        return jnp.maximum(a, b)
    return a + b


def loss_and_grads(graphdef, params, batch, objective=SupervisedLoss(), ref_params=None,
                   remat: str = "none"):
    """sum(loss_sum) / sum(weight) over the microbatches of `batch` ([M, ...] arrays), its
    gradient (accumulated in float32) and the objective's metrics. A microbatch with nothing to
    learn from (loss_mask all zero, e.g. padding of a packed RL step) is skipped, not computed."""
    ref_model = None if ref_params is None else merge_params(graphdef, ref_params)
    layer_fn = remat_layer(decoder_layer, remat)

    def mb_loss(p, mb):
        loss_sum, weight, stats = objective(merge_params(graphdef, p), mb, ref_model, layer_fn)
        return loss_sum, (weight, stats)

    grad_fn = jax.value_and_grad(mb_loss, has_aux=True)
    (loss0, (weight0, stats0)), grads0 = jax.eval_shape(
        grad_fn, params, jax.tree.map(lambda x: x[0], batch))
    identity = {k: jnp.full(v.shape, jnp.inf if k.endswith("_min") else
                            -jnp.inf if k.endswith("_max") else 0.0, v.dtype)
                for k, v in stats0.items()}
    nothing = ((jnp.zeros(loss0.shape, loss0.dtype), (jnp.zeros(weight0.shape, weight0.dtype),
                                                     identity)),
               jax.tree.map(lambda g: jnp.zeros(g.shape, g.dtype), grads0))

    def accumulate(carry, mb):
        grads, loss, weight, stats = carry
        (mb_loss_sum, (mb_weight, mb_stats)), mb_grads = jax.lax.cond(
            jnp.any(mb["loss_mask"] > 0), lambda: grad_fn(params, mb), lambda: nothing)
        grads = jax.tree.map(lambda g, d: g + d.astype(jnp.float32), grads, mb_grads)
        stats = {k: _combine(k, stats[k], v) for k, v in mb_stats.items()}
        return (grads, loss + mb_loss_sum, weight + mb_weight, stats), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    (grads, loss, weight, stats), _ = jax.lax.scan(
        accumulate, (zeros, 0.0, 0.0, identity), batch)
    weight = jnp.maximum(weight, 1.0)
    grads = jax.tree.map(lambda g, p: (g / weight).astype(p.dtype), grads, params)
    return loss / weight, grads, objective.summarize(stats)


def make_train_step(graphdef, tx: optax.GradientTransformation, schedule=None,
                    objective=SupervisedLoss(), remat: str = "none") -> Callable:
    """`step(state, batch) -> (state, metrics)`, not yet jitted (see `jit_train_step`). A state
    with `ref_params` (a frozen reference model) hands them to the objective."""

    def step(state, batch):
        loss, grads, aux = loss_and_grads(graphdef, state["params"], batch, objective,
                                          state.get("ref_params"), remat)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), **aux}
        if schedule is not None:
            metrics["lr"] = schedule(state["step"])
        return {**state, "params": params, "opt_state": opt_state,
                "step": state["step"] + 1}, metrics

    return step


def state_shardings(model_cfg: ModelConfig, tx, mesh: Mesh, rules=shd.RULES):
    """NamedShardings of the whole train state: parameters by their logical axes, optimizer
    moments like their parameters, scalars replicated."""
    _, abstract = split_params(abstract_model(model_cfg))
    params = shd.tree_shardings(param_axes(model_cfg), abstract, mesh, rules)
    opt_abstract = jax.eval_shape(tx.init, abstract)
    opt = optax.tree_map_params(
        tx, lambda _, s: s, opt_abstract, params,
        transform_non_params=lambda _: shd.replicated(mesh),
        is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    rep = shd.replicated(mesh)
    return {"params": params, "opt_state": opt, "step": rep, "rng": rep}


def abstract_state(model_cfg: ModelConfig, tx, shardings):
    """ShapeDtypeStructs (with shardings) of the train state, the target of a restore."""
    _, abstract = split_params(abstract_model(model_cfg))
    shapes = {"params": abstract, "opt_state": jax.eval_shape(tx.init, abstract),
              "step": jax.ShapeDtypeStruct((), jnp.int32),
              "rng": jax.ShapeDtypeStruct((2,), jnp.uint32)}
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        shapes, shardings)


def init_state(model_cfg: ModelConfig, tx, shardings, seed: int, params=None):
    """A fresh train state created directly in its shardings (never whole on one device).
    `params`, when given (e.g. from a Hugging Face checkpoint), replace the random init."""

    def init(p):
        if p is None:
            p = split_params(Transformer(model_cfg, rngs=nnx.Rngs(seed)))[1]
        return {"params": p, "opt_state": tx.init(p), "step": jnp.zeros((), jnp.int32),
                "rng": jax.random.key_data(jax.random.key(seed))}

    if params is not None:
        params = jax.device_put(params, shardings["params"])
    return jax.jit(init, out_shardings=shardings)(params)


def jit_train_step(graphdef, tx, shardings, mesh: Mesh, schedule=None, rules=shd.RULES,
                   remat: str = "none"):
    """The train step compiled for the mesh; the state is donated and updated in place."""
    batch = shd.batch_sharding(mesh, 3, rules, leading=1)
    return jax.jit(make_train_step(graphdef, tx, schedule, remat=remat),
                   in_shardings=(shardings, batch),
                   out_shardings=(shardings, shd.replicated(mesh)),
                   donate_argnums=0)


def split_microbatches(batch: dict[str, np.ndarray], microbatches: int) -> dict:
    """[B, T] host arrays -> [M, B/M, T]."""
    return {k: v.reshape(microbatches, v.shape[0] // microbatches, *v.shape[1:])
            for k, v in batch.items()}
