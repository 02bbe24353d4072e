"""The trainer side of RL: its state (resumed from the newest RL checkpoint, or a fresh RL
optimizer on the warm-up's weights), its jitted sharded step, and its checkpoints."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxrl.config import ConfigError, RunConfig
from jaxrl.models import abstract_model, from_hf
from jaxrl.models.transformer import split_params
from jaxrl.train.checkpoint import Checkpointer
from jaxrl.train.objectives import PolicyGradientLoss
from jaxrl.train.optim import lr_schedule, make_optimizer
from jaxrl.train.step import (
    abstract_state,
    init_state,
    make_train_step,
    optimizer_on_device,
    state_shardings,
)
from sharding import hosts
from sharding import mesh as shd
from sharding.layer_order import LayerOrder, converter


def make_objective(cfg: RunConfig) -> PolicyGradientLoss:
    rl = cfg.rl
    return PolicyGradientLoss(kind=rl.loss, temperature=rl.temperature, tis_cap=rl.tis_cap,
                              clip_low=rl.clip_low, clip_high=rl.clip_high,
                              kl_coef=rl.kl_coef, max_segments=rl.max_segments,
                              logits_chunk=cfg.train.logits_chunk,
                              behaviour=rl.behaviour_logprobs)


class RLTrainer:
    """`state` and `step` (the optimizer step reached); `data` is what the RL checkpoint it
    resumed from saved beside the state (None when RL starts from the warm-up's weights, then
    `restarted` is True)."""

    def __init__(self, cfg: RunConfig, model_cfg, mesh, log: Callable[[str], None] = print):
        rl, first_rl = cfg.rl, cfg.train.steps
        self.mesh = mesh
        model_cfg = model_cfg.for_platform(mesh.devices.flat[0].platform)
        self.ckpt = Checkpointer(cfg.checkpoint_dir, keep=cfg.checkpoint.keep,
                                 async_save=cfg.checkpoint.async_save)
        tx = make_optimizer(rl.optim, rl.steps)
        schedule = lr_schedule(rl.optim, rl.steps)
        shardings = state_shardings(model_cfg, tx, mesh,
                                    offload_optimizer=cfg.train.offload_optimizer)
        if rl.kl_coef > 0:
            shardings["ref_params"] = shardings["params"]
        # Checkpoints and weight pushes hold the canonical layer order; the state, the
        # pipeline's (sharding/layer_order.py).
        order = LayerOrder.for_pipeline(cfg.sharding.pipeline, model_cfg.num_layers)
        on_device = optimizer_on_device(shardings)
        self._to_canonical = converter(order, "canonical", shardings, on_device)
        self._canonical_params = converter(order, "canonical", shardings["params"])
        self.data, state = self._restore_or_init(cfg, model_cfg, tx, shardings, log)
        self.state = converter(order, "pipeline", shardings, on_device)(state)
        self.restarted = self.data is None
        graphdef, _ = split_params(abstract_model(model_cfg))
        self.batch_sharding = shd.batch_sharding(mesh, 3, leading=1)
        self._step_fn = jax.jit(
            make_train_step(graphdef, tx, lambda s: schedule(s - first_rl),
                            make_objective(cfg), remat=cfg.train.remat,
                            pipeline=cfg.sharding.pipeline, mesh=mesh, opt_device=on_device,
                            pipeline_order=order is not None),
            in_shardings=(shardings, self.batch_sharding),
            out_shardings=(shardings, shd.replicated(mesh)), donate_argnums=0)
        self.step = int(self.state["step"])
        self._cast = None

    def _restore_or_init(self, cfg: RunConfig, model_cfg, tx, shardings, log):
        rl, first_rl, ckpt = cfg.rl, cfg.train.steps, self.ckpt
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
            return None, ckpt.restore({"params": target["params"]}, step,
                                      params_only=True)["params"]

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
        # A fresh RL optimizer on the warm-up's weights (or, without warm-up, the model's).
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

    @property
    def params(self):
        """The parameters in canonical layer order (what the engines serve)."""
        return self._canonical_params(self.state["params"])

    def train(self, arrays) -> dict:
        """One optimizer step on a batch's arrays; its metrics (host floats). On several
        processes the arrays are the whole batch in host memory, the same on each: every
        process puts only its own rows on its devices."""
        if jax.process_count() > 1:
            sharding = self.batch_sharding
            arrays = hosts.global_batch(
                {k: v[hosts.local_box(sharding, v.shape)] for k, v in arrays.items()},
                sharding, {k: v.shape for k, v in arrays.items()})
        self.state, metrics = jax.block_until_ready(self._step_fn(self.state, arrays))
        self.step += 1
        return {k: float(v) for k, v in jax.device_get(metrics).items()}

    def gathered_params(self, dtype) -> dict:
        """On several processes (a collective: all of them call it): the parameters whole, in
        `dtype`, in host memory, for process 0 to push to the generation servers."""
        if self._cast is None:
            self._cast = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(dtype), p))
        return hosts.fully_addressable(self._cast(self.params))

    def save(self, config: dict, data: dict) -> None:
        self.ckpt.save(self._to_canonical(self.state), config, data=data)

    def close(self) -> None:
        self.ckpt.wait()
        self.ckpt.close()
