"""A training client's state (adapters, Adam's moments and step) as an Orbax checkpoint:
`tinker://MODEL_ID/weights/NAME` is STATE_DIR/MODEL_ID/weights/NAME, a PyTree checkpoint any
Orbax reader restores, beside `tinker.json` (base model, LoRA rank and targets). Orbax writes to
a temporary folder and renames it when complete: a crash leaves no half-written checkpoint.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxrl.tinker.errors import UserFault
from jaxrl.tinker.training import Client, lora_config

_PATH = re.compile(r"^tinker://([A-Za-z0-9_.:-]+)/weights/([A-Za-z0-9_.-]+)$")
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def folder(state_dir: Path, path: str) -> Path:
    match = _PATH.match(path)
    if not match:
        raise UserFault(f"checkpoint path {path!r}: tinker://MODEL_ID/weights/NAME")
    return state_dir / match[1] / "weights" / match[2]


def save(state_dir: Path, client: Client, name: str | None) -> str:
    name = name or f"step-{client.step:06d}"
    if not _NAME.match(name):
        raise UserFault(f"checkpoint name {name!r}: letters, digits, '_', '-' and '.'")
    path = f"tinker://{client.model_id}/weights/{name}"
    where = folder(state_dir, path)
    if where.exists():
        raise UserFault(f"{path} exists already; save under another name")
    where.parent.mkdir(parents=True, exist_ok=True)
    tree = {"adapters": client.adapters, "m": client.m, "v": client.v,
            "step": np.asarray(client.step, np.int64)}
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(where.absolute() / "state", tree)
    lo = client.lora
    meta = {"base_model": client.base_model, "rank": lo.rank,
            "train_attn": "q_proj" in lo.modules(), "train_mlp": "up_proj" in lo.modules()}
    (where / "tinker.json").write_text(json.dumps(meta))
    return path


def load(state_dir: Path, client: Client, path: str, optimizer: bool) -> None:
    """Restores `path` into `client`; with `optimizer`, Adam's moments and step too (else
    they start afresh). UserFault for a missing checkpoint or one of another adapter shape."""
    where = folder(state_dir, path)
    if not (where / "tinker.json").exists():
        raise UserFault(f"no checkpoint at {path}")
    meta = json.loads((where / "tinker.json").read_text())
    lo = lora_config(meta["rank"], meta["train_attn"], meta["train_mlp"])
    if (lo.rank, lo.modules()) != (client.lora.rank, client.lora.modules()):
        raise UserFault(f"{path} holds LoRA rank {lo.rank} on {','.join(lo.modules())}; "
                        f"{client.model_id} has rank {client.lora.rank} on "
                        f"{','.join(client.lora.modules())}")
    target = {"adapters": client.adapters, "m": client.m, "v": client.v,
              "step": np.asarray(0, np.int64)}
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    with ocp.StandardCheckpointer() as ckpt:
        tree = ckpt.restore(where.absolute() / "state", abstract)
    client.adapters = tree["adapters"]
    if optimizer:
        client.m, client.v, client.step = tree["m"], tree["v"], int(tree["step"])
    else:
        client.m = jax.tree.map(np.zeros_like, tree["m"])
        client.v = jax.tree.map(np.zeros_like, tree["v"])
        client.step = 0
    client.grads = None


def checkpoint_lora(state_dir: Path, path: str) -> tuple[str, dict]:
    """(base model, the SDK's LoRA settings) of the checkpoint at `path`."""
    where = folder(state_dir, path)
    if not (where / "tinker.json").exists():
        raise UserFault(f"no checkpoint at {path}")
    meta = json.loads((where / "tinker.json").read_text())
    return meta["base_model"], {k: meta[k] for k in ("rank", "train_attn", "train_mlp")}
