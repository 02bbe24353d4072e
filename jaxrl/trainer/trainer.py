"""One trainer for the warm-up and RL: the model's state on the trainer's mesh, its jitted
sharded step for an objective and an optimizer passed in, and its checkpoints.

The state lives in the pipeline's layer order when a pipeline schedule asks for one; the
checkpoints and the weights the engines serve are in the canonical order
(sharding/layer_order.py). What differs between the phases is passed in: the objective (the
supervised loss, or the policy-gradient loss), the optimizer settings and their horizon, the
first step number (the learning-rate schedule counts from it), and how the phase restores or
initialises its state (`restore`).
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import jax

from jaxrl import executables
from jaxrl.config import RunConfig
from jaxrl.models import abstract_model
from jaxrl.models.transformer import split_params
from jaxrl.optim_config import OptimConfig
from jaxrl.train.checkpoint import Checkpointer, CheckpointError
from jaxrl.train.optim import lr_schedule, make_optimizer
from jaxrl.train.state import optimizer_on_device, state_shardings
from jaxrl.train.step import Layout, jit_train_step
from sharding import mesh as shd
from sharding.layer_order import LayerOrder, converter

# restore(checkpointer, model config, optimizer, shardings) -> (what the checkpoint saved
# beside the state, or None; the state in canonical layer order)
Restore = Callable[[Checkpointer, object, object, dict], tuple[dict | None, dict]]


def check_resume(cfg: RunConfig) -> int | None:
    """The newest checkpoint step in the run's checkpoint directory (None: none yet), or a
    CheckpointError when there is one and checkpoint.resume is false. Creates nothing."""
    ckpt = Checkpointer(cfg.checkpoint_dir, keep=cfg.checkpoint.keep)
    try:
        latest = ckpt.latest_step()
    finally:
        ckpt.close()
    if latest is not None and not cfg.checkpoint.resume:
        raise CheckpointError(
            f"{str(ckpt.path)!r} already holds checkpoints up to step {latest}; set "
            f"checkpoint.resume=true to continue that run, or choose a new checkpoint.dir")
    return latest


@dataclasses.dataclass(frozen=True)
class Phase:
    """What a trainer trains: its `objective`, its optimizer settings, the `steps` its
    learning-rate schedule runs over, and the step it begins at (RL's follow the warm-up's)."""

    objective: object
    optim: OptimConfig
    steps: int
    first_step: int = 0


class Trainer:
    """`state` (restored or initialised by `restore`), `step` (the optimizer step reached),
    `data` (what the checkpoint it resumed from saved beside the state, or None)."""

    def __init__(self, cfg: RunConfig, model_cfg, mesh, phase: Phase, restore: Restore, *,
                 ref_params: bool = False):
        self.mesh = mesh
        self.model_cfg = model_cfg = model_cfg.for_platform(mesh.devices.flat[0].platform,
                                                            mesh.devices.size)
        self.ckpt = Checkpointer(cfg.checkpoint_dir, keep=cfg.checkpoint.keep,
                                 async_save=cfg.checkpoint.async_save)
        try:
            self._build(cfg, phase, restore, ref_params)
        except BaseException:
            self.ckpt.close()
            raise

    def _build(self, cfg, phase: Phase, restore: Restore, ref_params: bool) -> None:
        model_cfg, mesh = self.model_cfg, self.mesh
        tx = make_optimizer(phase.optim, phase.steps)
        schedule = lr_schedule(phase.optim, phase.steps)
        shardings = state_shardings(model_cfg, tx, mesh,
                                    offload_optimizer=cfg.train.offload_optimizer)
        if ref_params:
            shardings["ref_params"] = shardings["params"]
        order = LayerOrder.for_pipeline(cfg.sharding.pipeline, model_cfg.num_layers)
        on_device = optimizer_on_device(shardings)
        self._to_canonical = converter(order, "canonical", shardings, on_device)
        self._canonical_params = converter(order, "canonical", shardings["params"])
        self.data, state = restore(self.ckpt, model_cfg, tx, shardings)
        self.state = converter(order, "pipeline", shardings, on_device)(state)
        self.graphdef, _ = split_params(abstract_model(model_cfg))
        self.batch_sharding = shd.batch_sharding(mesh, 3, leading=1)
        layout = Layout(mesh, cfg.train.remat, cfg.sharding.pipeline, order is not None)
        self._step_fn = jit_train_step(self.graphdef, tx, shardings, layout,
                                       lambda s: schedule(s - phase.first_step),
                                       phase.objective,
                                       width=model_cfg.embed_dim)
        self.step = int(self.state["step"])
        # What fixes the step's program beside its arguments (jaxrl/executables.py).
        self._program = ("train_step", model_cfg, phase, cfg.train, cfg.sharding, ref_params)
        self._compiling: Future | None = None
        self._compiled = None   # (the batch's abstract arrays, the executable)

    def compile_async(self, like: dict) -> None:
        """Compiles the step for batches shaped like `like` (name -> array) in a thread of its
        own, beside what this process compiles meanwhile (RL: the engine's programs), or loads
        it as an earlier run compiled it (jaxrl/executables.py); the first step waits for it.
        A batch of any other shape or placement goes through the jitted step as before."""
        abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=self.batch_sharding)
                    for k, v in like.items()}
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                            sharding=x.sharding), self.state)
        pool = ThreadPoolExecutor(1, thread_name_prefix="train-step-compile")
        try:
            self._compiling = pool.submit(lambda: (abstract, executables.load_or_compile(
                lambda: self._step_fn.lower(state, abstract), self._program, (state, abstract),
                list(self.mesh.devices.flat))))
        finally:
            pool.shutdown(wait=False)   # the thread ends with its one task

    def _executable(self, batch):
        if self._compiling is not None:
            future, self._compiling = self._compiling, None
            self._compiled = future.result()
        if self._compiled is not None:
            abstract, executable = self._compiled
            if batch.keys() == abstract.keys() and all(
                    (v.shape, v.dtype, getattr(v, "sharding", None))
                    == (abstract[k].shape, abstract[k].dtype, abstract[k].sharding)
                    for k, v in batch.items()):
                return executable
        return self._step_fn

    @property
    def params(self):
        """The parameters in canonical layer order (what checkpoints hold and engines serve)."""
        return self._canonical_params(self.state["params"])

    def run_step(self, batch) -> dict:
        """One optimizer step on a batch already placed on the mesh; its metrics, left on the
        device (the caller decides when to wait for them)."""
        self.state, metrics = self._executable(batch)(self.state, batch)
        self.step += 1
        return metrics

    def set_step(self, step: int) -> None:
        """Numbers the state's step (the warm-up's early stop saves its weights as the step
        where RL begins); the optimizer's own count is unchanged."""
        self.state["step"] = jax.device_put(jax.numpy.int32(step), self.state["step"].sharding)
        self.step = step

    def save(self, config: dict, data: dict | None = None) -> None:
        self.ckpt.save(self._to_canonical(self.state), config, data=data)

    def close(self) -> None:
        if self._compiling is not None:   # never stepped: its compile thread ends first
            self._compiling.exception()
        self.ckpt.wait()
        self.ckpt.close()
