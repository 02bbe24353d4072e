"""The trainer side of RL: the one trainer (trainer.py) with the policy-gradient objective,
RL's optimizer, and RL's way to resume (the newest RL checkpoint, or a fresh RL optimizer on
the warm-up's weights)."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxrl.config import ConfigError, RunConfig
from jaxrl.models import from_hf, lora, quant
from jaxrl.rollout.publisher import wire_dtype
from jaxrl.models.transformer import split_params
from jaxrl.train.objectives import PolicyGradientLoss
from jaxrl.train.state import abstract_state, init_state
from jaxrl.trainer.trainer import Phase, Trainer
from sharding import hosts


def make_objective(cfg: RunConfig) -> PolicyGradientLoss:
    rl = cfg.rl
    return PolicyGradientLoss(kind=rl.loss, temperature=rl.temperature, tis_cap=rl.tis_cap,
                              clip_low=rl.clip_low, clip_high=rl.clip_high,
                              kl_coef=rl.kl_coef, max_segments=rl.max_segments,
                              logits_chunk=cfg.train.logits_chunk,
                              behaviour=rl.behaviour_logprobs, moe_routing=rl.moe_routing,
                              correction=rl.rollout_correction,
                              correction_low=rl.correction_low,
                              correction_high=rl.correction_high)


class RLTrainer(Trainer):
    """The RL phase's trainer (jaxrl/trainer/trainer.py) with the policy-gradient objective and
    RL's optimizer: resumed from the newest RL checkpoint, or a fresh optimizer on the
    warm-up's weights, in which case `restarted` is True and `data` None."""

    def __init__(self, cfg: RunConfig, model_cfg, mesh, log: Callable[[str], None] = print):
        rl = cfg.rl
        super().__init__(cfg, model_cfg, mesh,
                         Phase(make_objective(cfg), rl.optim, rl.steps, cfg.train.steps),
                         lambda *args: _restore_or_init(cfg, *args, log),
                         ref_params=rl.kl_coef > 0)
        self.restarted = self.data is None
        self._cast = None

    def train(self, arrays) -> dict:
        """One optimizer step on a batch's arrays; its metrics (host floats). On several
        processes the arrays are the whole batch in host memory, the same on each: every
        process puts only its own rows on its devices."""
        if jax.process_count() > 1:
            sharding = self.batch_sharding
            arrays = hosts.global_batch(
                {k: v[hosts.local_box(sharding, v.shape)] for k, v in arrays.items()},
                sharding, {k: v.shape for k, v in arrays.items()})
        metrics = jax.block_until_ready(self.run_step(arrays))
        return {k: float(v) for k, v in jax.device_get(metrics).items()}

    def gathered_params(self, dtype) -> dict:
        """On several processes (a collective: all of them call it): the parameters whole, in
        `dtype` (`publisher.wire_dtype`), in host memory, for process 0 to push to the
        generation servers."""
        if self._cast is None:
            self._cast = jax.jit(lambda p: jax.tree_util.tree_map_with_path(
                lambda path, x: x.astype(wire_dtype(path, x, dtype)), p))
        return hosts.fully_addressable(self._cast(self.params))


def _restore_or_init(cfg: RunConfig, ckpt, model_cfg, tx, shardings, log):
    """(data, state): the newest RL checkpoint's, or (None, a fresh RL optimizer on the
    warm-up's weights, else the Hugging Face folder's, else a random initialisation)."""
    rl, first_rl = cfg.rl, cfg.train.steps
    latest = ckpt.latest_step()
    if first_rl and (latest is None or latest < first_rl):
        raise ConfigError(f"RL starts from the warm-up's checkpoint at step {first_rl}; "
                          f"{ckpt.path} holds {latest}")
    own = {k: v for k, v in shardings.items() if k != "ref_params"}
    target = abstract_state(model_cfg, tx, own)
    if rl.kl_coef > 0:
        target["ref_params"] = target["params"]

    def load(step):   # an RL checkpoint: (data, state); the warm-up's: (None, params)
        data = ckpt.saved_data(step)
        if data is not None:
            return data, ckpt.restore(target, step)
        # A warm-up from a random initialisation saved no adapters and full-precision weights
        # (warmup.warmup_model): its weights are the base; init_state quantizes them
        # (model.quantize) and adds fresh adapters.
        params = target["params"]
        if model_cfg.lora.enabled and not cfg.hf_path:
            params = quant.as_float(lora.frozen(params), model_cfg)
        return None, ckpt.restore({"params": params}, step, params_only=True)["params"]

    data = restored = None
    if latest is not None:
        latest, loaded = ckpt.restore_newest(load, log)
        data, restored = loaded if latest is not None else (None, None)
    if first_rl and (latest is None or latest < first_rl):
        raise ConfigError(f"RL starts from the warm-up's checkpoint at step {first_rl}; "
                          f"{ckpt.path} holds {latest} (after setting aside unreadable "
                          f"steps)")
    if data is not None:  # an RL checkpoint: resume everything
        log(f"resumed RL from {ckpt.path}/{latest}")
        return data, restored
    if latest is not None:
        params = restored
    elif cfg.hf_path:
        params = split_params(from_hf(cfg.hf_path, model_cfg.dtype,
                                      param_dtype=model_cfg.param_dtype))[1]
        log(f"RL starts from {cfg.hf_path} (no warm-up)")
    else:
        params = None  # random initialisation
    state = init_state(model_cfg, tx, own, cfg.train.seed, params)
    state["step"] = jax.device_put(jnp.asarray(first_rl, jnp.int32), shardings["step"])
    if rl.kl_coef > 0:
        state["ref_params"] = jax.tree.map(jnp.copy, state["params"])
    return None, state
