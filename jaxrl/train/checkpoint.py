"""Orbax checkpoints in the plain CheckpointManager layout:

    <dir>/<step>/params       the model parameters (a pure dict; restorable with orbax alone)
    <dir>/<step>/opt_state    the optax state
    <dir>/<step>/train_state  {step, rng}
    <dir>/<step>/config       the run config as JSON
    <dir>/<step>/ref_params   RL only, with a KL penalty: the frozen reference model
    <dir>/<step>/data         RL only: the input pipeline's state (Grain iterator state, the
                              rollouts generated but not yet trained on, the next problem)

Saves are atomic (Orbax writes to a temporary folder and renames it) and asynchronous by choice.
A directory that holds anything but checkpoints is refused before anything is written.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxrl.errors import UserError

_STEP_DIR = re.compile(r"^\d+$")
_TMP_DIR = re.compile(r".*\.orbax-checkpoint-tmp.*")


class CheckpointError(UserError):
    """A checkpoint directory that cannot be used; the message says why and what to do."""


def _check_directory(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"checkpoint directory {str(path)!r} is a file, not a directory")
    if path.is_dir():
        strangers = sorted(p.name for p in path.iterdir()
                           if not (_STEP_DIR.match(p.name) or _TMP_DIR.match(p.name)))
        if strangers:
            raise CheckpointError(
                f"refusing to use {str(path)!r} as a checkpoint directory: it holds other files "
                f"({', '.join(strangers[:3])}); choose an empty or new directory")


def has_checkpoint(directory: str | Path) -> bool:
    """Whether `directory` holds at least one saved step."""
    path = Path(directory)
    return path.is_dir() and any(_STEP_DIR.match(p.name) for p in path.iterdir())


class Checkpointer:
    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True,
                 create: bool = True):
        self.path = Path(directory).expanduser().absolute()
        _check_directory(self.path)
        if not create and not self.path.is_dir():
            raise CheckpointError(f"no checkpoint directory at {str(self.path)!r}")
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create,
                                               enable_async_checkpointing=async_save)
        self._manager = ocp.CheckpointManager(self.path, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, state: dict, config: dict[str, Any], *, data: dict | None = None,
             force: bool = False) -> bool:
        step = int(jax.device_get(state["step"]))
        items = dict(
            params=ocp.args.StandardSave(state["params"]),
            opt_state=ocp.args.StandardSave(state["opt_state"]),
            train_state=ocp.args.StandardSave({"step": state["step"], "rng": state["rng"]}),
            config=ocp.args.JsonSave(config))
        if "ref_params" in state:
            items["ref_params"] = ocp.args.StandardSave(state["ref_params"])
        if data is not None:
            items["data"] = ocp.args.JsonSave(data)
        return self._manager.save(step, force=force, args=ocp.args.Composite(**items))

    def saved_data(self, step: int | None = None) -> dict[str, Any] | None:
        """The `data` item of a step (None if it has none, e.g. a warm-up step)."""
        step = self.resolve_step(step)
        if not (self.path / str(step) / "data").exists():
            return None
        return self._manager.restore(step, args=ocp.args.Composite(
            data=ocp.args.JsonRestore())).data

    def saved_config(self, step: int | None = None) -> dict[str, Any]:
        step = self.resolve_step(step)
        return self._manager.restore(step, args=ocp.args.Composite(
            config=ocp.args.JsonRestore())).config

    def restore(self, abstract: dict, step: int | None = None, *,
                params_only: bool = False) -> dict:
        """Restores into `abstract` (ShapeDtypeStructs with shardings): each array is read
        straight into its shards."""
        step = self.resolve_step(step)
        items = {"params": ocp.args.StandardRestore(abstract["params"])}
        if "ref_params" in abstract:
            items["ref_params"] = ocp.args.StandardRestore(abstract["ref_params"])
        if not params_only:
            items.update(
                opt_state=ocp.args.StandardRestore(abstract["opt_state"]),
                train_state=ocp.args.StandardRestore(
                    {"step": abstract["step"], "rng": abstract["rng"]}))
        try:
            out = self._manager.restore(step, args=ocp.args.Composite(**items))
        except (ValueError, KeyError, FileNotFoundError) as e:
            raise CheckpointError(f"cannot restore step {step} from {str(self.path)!r}: "
                                  f"{e}") from e
        ref = {"ref_params": out.ref_params} if "ref_params" in abstract else {}
        if params_only:
            return {"params": out.params, **ref}
        return {"params": out.params, "opt_state": out.opt_state, **out.train_state, **ref}

    def resolve_step(self, step: int | None) -> int:
        steps = self.all_steps()
        if not steps:
            raise CheckpointError(f"no checkpoint in {str(self.path)!r}")
        if step is None:
            return max(steps)
        if step not in steps:
            raise CheckpointError(f"no checkpoint for step {step} in {str(self.path)!r}; "
                                  f"saved steps: {steps}")
        return step

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()
