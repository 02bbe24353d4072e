"""`jaxrl compile --topology v5e:2x4`: the train step compiled ahead of time for a TPU slice on
a machine without one (JAX + libtpu), and the per-device memory it would need."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.config import RunConfig
from jaxrl.models import abstract_model
from jaxrl.models.transformer import split_params
from jaxrl.run.warmup import model_config
from jaxrl.train.optim import lr_schedule, make_optimizer
from jaxrl.train.step import abstract_state, jit_train_step, state_shardings
from sharding import mesh as shd
from sharding.aot import tpu_devices

# HBM per chip, bytes.
HBM_BYTES = {"v4": 32 * 2**30, "v5e": 16 * 2**30, "v5p": 95 * 2**30, "v6e": 32 * 2**30}


def compile_train_step(cfg: RunConfig, topology: str) -> dict:
    """Per-device bytes of the supervised train step of `cfg` compiled for `topology`."""
    devices = tpu_devices(topology)
    mesh = shd.make_mesh(cfg.mesh, devices)
    model_cfg = model_config(cfg)
    tx = make_optimizer(cfg.optim, cfg.train.steps or 1)
    shardings = state_shardings(model_cfg, tx, mesh)
    state = abstract_state(model_cfg, tx, shardings)
    graphdef, _ = split_params(abstract_model(model_cfg))
    step = jit_train_step(graphdef, tx, shardings, mesh, lr_schedule(cfg.optim, 1),
                          remat=cfg.train.remat, pipeline=cfg.sharding.pipeline)
    t = cfg.train
    shape = (t.microbatches, t.batch_size // t.microbatches, t.seq_len)
    sharding = shd.batch_sharding(mesh, 3, leading=1)
    batch = {k: jax.ShapeDtypeStruct(shape, dt, sharding=sharding) for k, dt in
             (("input_ids", jnp.int32), ("targets", jnp.int32), ("loss_mask", jnp.float32))}
    memory = step.lower(state, batch).compile().memory_analysis()
    out = {"device_temp_bytes": int(memory.temp_size_in_bytes),
           "host_temp_bytes": int(memory.host_temp_size_in_bytes),
           "argument_bytes": int(memory.argument_size_in_bytes),
           "output_bytes": int(memory.output_size_in_bytes)}
    hbm = HBM_BYTES[topology.split(":")[0]]
    out["fits"] = out["device_temp_bytes"] + out["argument_bytes"] <= hbm
    return out
