"""LoRA against full fine-tuning: one train step's time and its state's bytes, side by side.

The same model and batch, three train steps: every weight trained with AdamW, and LoRA adapters
of rank `--rank` on every projection, or on the attention's alone, with the base frozen (no
weight gradient formed for it, no optimizer state). The steps run in alternating rounds in one process; each figure is the
best round. The defaults are the 30M peer job's shape (bench/peers/job.py: 576 wide, 8 layers,
a microbatch of 16 samples of 81 tokens).

    jaxrl bench lora_step [--rank 16] [--rows 16] [--tokens 81] [--rounds 5]
    (or: .venv/bin/python bench/lora_step.py ...)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from _machine import best_seconds  # noqa: E402
from jaxrl.models import ModelConfig, abstract_model, split_params  # noqa: E402
from jaxrl.models.lora import LoraConfig  # noqa: E402
from jaxrl.train.state import init_state, state_shardings  # noqa: E402
from jaxrl.train.step import Layout, jit_train_step  # noqa: E402
from sharding import mesh as shd  # noqa: E402


def _step(cfg: ModelConfig, batch: dict):
    """(a call running one train step on a fresh state, the state's bytes)."""
    mesh = shd.make_mesh(shd.MeshConfig(), jax.devices()[:1])
    tx = optax.adamw(1e-5)
    shardings = state_shardings(cfg, tx, mesh)
    state = init_state(cfg, tx, shardings, 0)
    graphdef, _ = split_params(abstract_model(cfg))
    step = jit_train_step(graphdef, tx, shardings, Layout(mesh), width=cfg.embed_dim)
    box = [state]

    def call():
        box[0], metrics = step(box[0], batch)
        return metrics["loss"]

    nbytes = sum(a.nbytes for a in jax.tree.leaves(state))
    return call, nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rows", type=int, default=16, help="samples in the microbatch")
    ap.add_argument("--tokens", type=int, default=81, help="tokens per sample")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    full = ModelConfig(vocab_size=32000, embed_dim=576, num_layers=8, num_heads=8,
                       num_kv_heads=4, head_dim=72, mlp_dim=1536,
                       max_seq_len=args.tokens).for_platform("cpu")
    lora = lambda targets: dataclasses.replace(full, lora=LoraConfig(  # noqa: E731
        rank=args.rank, alpha=2 * args.rank, targets=targets))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, full.vocab_size, (1, args.rows, args.tokens)).astype(np.int32)
    batch = {"input_ids": ids, "targets": np.roll(ids, -1, -1),
             "loss_mask": np.ones(ids.shape, np.float32)}
    calls = {"full": _step(full, batch),
             f"lora r={args.rank}, all-linear": _step(lora(("all-linear",)), batch),
             f"lora r={args.rank}, attention": _step(lora(("q_proj", "k_proj", "v_proj",
                                                           "o_proj")), batch)}
    best = {name: float("inf") for name in calls}
    for _ in range(args.rounds):
        for name, (call, _) in calls.items():
            best[name] = min(best[name], best_seconds(call, repeats=1, batch=2))
    print(f"| training | step (best of {args.rounds}) | x full | train state |")
    print("|---|---:|---:|---:|")
    for name, (_, nbytes) in calls.items():
        print(f"| {name} | {best[name] * 1e3:.1f} ms | {best['full'] / best[name]:.2f} | "
              f"{nbytes / 2**20:.1f} MiB |")
    print(json.dumps({"step_s": best, "state_bytes": {k: v[1] for k, v in calls.items()}}))


if __name__ == "__main__":
    main()
