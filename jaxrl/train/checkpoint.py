"""Orbax checkpoints in the plain CheckpointManager layout:

    <dir>/<step>/params       the model parameters (a pure dict; restorable with orbax alone)
    <dir>/<step>/opt_state    the optax state
    <dir>/<step>/train_state  {step, rng}
    <dir>/<step>/config       the run config as JSON
    <dir>/<step>/ref_params   RL only, with a KL penalty: the frozen reference model
    <dir>/<step>/data         RL only: the input pipeline's state (Grain iterator state, the
                              rollouts generated but not yet trained on, the next problem)

Saves are atomic (Orbax writes to a temporary folder and renames it) and asynchronous by choice.
A directory that holds anything but checkpoints is refused before anything is written. A step
that cannot be read back (a truncated array file, a disk error) is moved aside to
`<dir>.bad/<step>`, never deleted, and the step before it is used (`restore_newest`).
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

import jax
import orbax.checkpoint as ocp

from jaxrl.errors import UserError

T = TypeVar("T")
_STEP_DIR = re.compile(r"^\d+$")
_TMP_DIR = re.compile(r".*\.orbax-checkpoint-tmp.*")


class CheckpointError(UserError):
    """A checkpoint directory that cannot be used; the message says why and what to do."""


class CorruptCheckpoint(CheckpointError):
    """A saved step whose files cannot be read back."""


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
            raise CorruptCheckpoint(f"cannot restore step {step} from {str(self.path)!r}: "
                                    f"{e}") from e
        ref = {"ref_params": out.ref_params} if "ref_params" in abstract else {}
        if params_only:
            return {"params": out.params, **ref}
        return {"params": out.params, "opt_state": out.opt_state, **out.train_state, **ref}

    def restore_newest(self, load: Callable[[int], T], log: Callable[[str], None] = print
                       ) -> tuple[int | None, T | None]:
        """(step, load(step)) for the newest step that `load` can read, newest first. A step
        it cannot read is reported in one line and moved aside to `<dir>.bad/<step>`; (None,
        None) when no step is left. A user error `load` raises (e.g. the checkpoint is of
        another model) is not a broken step: it propagates and nothing is moved."""
        while (step := self.latest_step()) is not None:
            try:
                return step, load(step)
            except Exception as e:   # noqa: BLE001: whatever the reason, the step is unusable
                if isinstance(e, UserError) and not isinstance(e, CorruptCheckpoint):
                    raise
                aside = self._move_aside(step)
                reason = (str(e).strip().splitlines() or [""])[0][:200]
                log(f"checkpoint step {step} in {self.path} cannot be restored "
                    f"({type(e).__name__}: {reason}); moved to {aside}; trying the step "
                    f"before it")
        return None, None

    def _move_aside(self, step: int) -> Path:
        bad = self.path.parent / f"{self.path.name}.bad"
        bad.mkdir(parents=True, exist_ok=True)
        target = bad / str(step)
        if target.exists():
            target = bad / f"{step}.{time.strftime('%Y%m%d-%H%M%S')}"
        shutil.move(str(self.path / str(step)), str(target))
        self._manager.reload()
        return target

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
