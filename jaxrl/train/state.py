"""The train state, a plain dict `{params, opt_state, step, rng}` of arrays: its shardings, its
abstract shape (a restore's target), and a fresh one made directly in its shardings. Under LoRA
the optimizer's state covers the adapters alone (`trained`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from jaxrl.models import ModelConfig, Transformer, abstract_model, lora, param_axes, quant
from jaxrl.models.peft_io import read_adapter
from jaxrl.models.transformer import split_params
from sharding import mesh as shd


def state_shardings(model_cfg: ModelConfig, tx, mesh: Mesh, rules=shd.RULES,
                    offload_optimizer: bool = False):
    """NamedShardings of the whole train state: parameters by their logical axes, optimizer
    moments like their parameters, scalars replicated. `offload_optimizer`: the optimizer state
    lives in pinned host memory between steps (MaxText's optimizer offload); the step brings it
    to the device for the update (`optimizer_on_device`)."""
    _, abstract = split_params(abstract_model(model_cfg))
    params = shd.tree_shardings(param_axes(model_cfg), abstract, mesh, rules)
    opt_abstract = jax.eval_shape(tx.init, trained(model_cfg, abstract))
    opt = optax.tree_map_params(
        tx, lambda _, s: s, opt_abstract, trained(model_cfg, params),
        transform_non_params=lambda _: shd.replicated(mesh),
        is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    if offload_optimizer:
        opt = jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), opt)
    rep = shd.replicated(mesh)
    return {"params": params, "opt_state": opt, "step": rep, "rng": rep}


def optimizer_on_device(shardings):
    """Device shardings of a host-resident optimizer state, else None (nothing to move)."""
    opt = shardings["opt_state"]
    if all(s.memory_kind != "pinned_host" for s in jax.tree.leaves(opt)):
        return None
    return jax.tree.map(lambda s: s.with_memory_kind("device"), opt)


def abstract_state(model_cfg: ModelConfig, tx, shardings):
    """ShapeDtypeStructs (with shardings) of the train state, the target of a restore."""
    _, abstract = split_params(abstract_model(model_cfg))
    shapes = {"params": abstract,
              "opt_state": jax.eval_shape(tx.init, trained(model_cfg, abstract)),
              "step": jax.ShapeDtypeStruct((), jnp.int32),
              "rng": jax.ShapeDtypeStruct((2,), jnp.uint32)}
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        shapes, shardings)


def trained(model_cfg: ModelConfig, params):
    """What the optimizer updates of `params`: the LoRA adapters, or every parameter."""
    return lora.trainable(params) if model_cfg.lora.enabled else params


def init_state(model_cfg: ModelConfig, tx, shardings, seed: int, params=None):
    """A fresh train state created directly in its shardings (never whole on one device).
    `params`, when given (e.g. from a Hugging Face checkpoint), replace the random init; with
    model.quantize=int8 a full-precision base is quantized. Under LoRA, a base without
    adapters gets fresh ones (B zero), or those of the PEFT folder `model.lora.init_from`
    names."""
    lo = model_cfg.lora
    start = read_adapter(lo.init_from, model_cfg) if lo.enabled and lo.init_from else None

    def init(p, start):
        fresh = split_params(Transformer(model_cfg, rngs=nnx.Rngs(seed)))[1]
        if p is None:
            p = fresh
        else:
            p = quant.quantized(p, model_cfg)            # a full-precision base, model.quantize
            if lo.enabled and not lora.trainable(p)["layers"]:
                p = lora.with_trainable(p, lora.trainable(fresh))   # a base without adapters
        if start is not None:
            p = lora.with_trainable(p, start)
        return {"params": p, "opt_state": tx.init(trained(model_cfg, p)),
                "step": jnp.zeros((), jnp.int32),
                "rng": jax.random.key_data(jax.random.key(seed))}

    if params is not None:       # placed as the state will hold them (adapters added below)
        sh = shardings["params"]
        params = jax.device_put(params, {**sh, "layers": {
            k: v for k, v in sh["layers"].items() if k in params["layers"]}})
    if start is not None:
        start = jax.device_put(start, lora.trainable(shardings["params"]))
    return jax.jit(init, out_shardings=shardings)(params, start)
