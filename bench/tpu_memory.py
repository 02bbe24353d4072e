"""TPU memory per pipeline schedule and remat policy, from ahead-of-time compiles (libtpu).

Compiles the train step for a TPU slice on this machine (no TPU needed) once per pipeline
schedule and once per remat policy, all on the same model, batch and sequence length, and
prints per-device device temp, host temp and argument bytes with each one's ratio to the
baseline (gpipe; none). Where the compiler runs out of HBM, its own estimate is shown.

    jaxrl bench tpu_memory [--topology v5e:2x4] [--config configs/demo_cpu.yaml]
                           [--stages 2] [--microbatches 8] [section.key=value ...]
    (or: .venv/bin/python bench/tpu_memory.py ...)
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxrl.commands.compile import compile_train_step  # noqa: E402
from jaxrl.config import load_run_config  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def table(title: str, rows: list[tuple[str, str, dict]], extra: str = "") -> None:
    base = rows[0][2]["device_temp_bytes"]
    print(f"\n{title}")
    print(f"| {extra or 'variant'} | device temp MiB | x baseline | host temp MiB | "
          f"arguments MiB | fits |")
    print("|---|---:|---:|---:|---:|---|")
    for name, note, m in rows:
        mib = lambda k: f"{m[k] / 2**20:.1f}"  # noqa: E731
        print(f"| {name}{note} | {mib('device_temp_bytes')} | "
              f"{m['device_temp_bytes'] / base:.2f} | {mib('host_temp_bytes')} | "
              f"{mib('argument_bytes')} | {'yes' if m['fits'] else 'no'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--topology", default="v5e:2x4", help="TPU slice, GEN:AxB")
    parser.add_argument("--config", default=str(ROOT / "configs/demo_cpu.yaml"),
                        help="YAML run config")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages")
    parser.add_argument("--microbatches", type=int, default=8, help="pipeline microbatches")
    parser.add_argument("--sweep", default="8,16,32",
                        help="microbatch counts for the 1f1b memory sweep ('' for none)")
    parser.add_argument("overrides", nargs="*", default=["train.seq_len=64",
                                                         "model.max_seq_len=64"],
                        help="config overrides applied to every compile (not train.remat: "
                             "each row sets its own)")
    args = parser.parse_args()

    def compiled(*more: str) -> dict:
        cfg = load_run_config(args.config, [*args.overrides, *more])
        return compile_train_step(cfg, args.topology)

    pipe = [f"sharding.pipeline.stages={args.stages}",
            f"sharding.pipeline.microbatches={args.microbatches}"]
    none, offload = "train.remat=none", "train.remat=offload"
    schedules = [
        ("gpipe", [none]),
        ("circular, 2 repeats", [none, "sharding.pipeline.schedule=circular",
                                 "sharding.pipeline.repeats=2"]),
        ("1f1b", [none, "sharding.pipeline.schedule=1f1b"]),
        ("interleaved, 2 repeats", [none, "sharding.pipeline.schedule=interleaved",
                                    "sharding.pipeline.repeats=2"]),
        ("zb-h1", [none, "sharding.pipeline.schedule=zb-h1"]),
        ("zb-h1, W recomputes", [none, "sharding.pipeline.schedule=zb-h1",
                                 "sharding.pipeline.split_backward=recompute"]),
        ("v-half", [none, "sharding.pipeline.schedule=v-half"]),
        ("v-min", [none, "sharding.pipeline.schedule=v-min"]),
        ("v-zb", [none, "sharding.pipeline.schedule=v-zb"]),
        ("gpipe + stage inputs on host", [none, "sharding.pipeline.offload_stage_inputs=true"]),
        ("1f1b + remat=offload", [offload, "sharding.pipeline.schedule=1f1b"]),
    ]
    rows = []
    for name, more in schedules:
        cfg = load_run_config(args.config, [*args.overrides, *pipe, *more])
        table_ = cfg.sharding.pipeline.table
        note = f" (bubble {cfg.sharding.pipeline.bubble_fraction():.1%}"
        note += f", peak {float(table_.peak()):.2f})" if table_ is not None else ")"
        rows.append((name, note, compiled(*pipe, *more)))
    table(f"Pipeline schedules: {args.stages} stages x {args.microbatches} microbatches on "
          f"{args.topology} ({' '.join(args.overrides)})", rows, "schedule")

    sweep = [int(m) for m in args.sweep.split(",")] if args.sweep else []
    if sweep:
        rows = [(f"1f1b, {m} microbatches", "", compiled(
            f"sharding.pipeline.stages={args.stages}", f"sharding.pipeline.microbatches={m}",
            none, "sharding.pipeline.schedule=1f1b")) for m in sweep]
        table(f"1f1b as microbatches grow (the batch fixed): {args.stages} stages on "
              f"{args.topology}", rows, "schedule")

    rows = [(r, "", compiled(f"train.remat={r}")) for r in ("none", "full", "minimal",
                                                              "offload")]
    table(f"Remat policies, no pipeline, on {args.topology} ({' '.join(args.overrides)})",
          rows, "train.remat")


if __name__ == "__main__":
    main()
