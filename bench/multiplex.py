"""Devices that wait, generate: the pinned long-tail task in sync, partial and async, each with
and without the trainer's devices generating while it waits (rl.multiplex), side by side.

SeamlessFlow's spatiotemporal multiplexing and verl's idle-trainer generation: in a split
placement the trainer's devices idle through every sync and partial step's generation, and
whenever the async trainer waits for its batch. With rl.multiplex they run an engine of their
own beside the generation server while the trainer waits; when its batch is ready the engine's
unfinished groups continue on the server from the tokens they reached and the devices train
(jaxrl/rollout/fleet.py: lend, withdraw).

Every run starts from the same warm-up checkpoint (bench/_rl_compare.py), the trainer and a
launched `jaxrl serve` on cores of their own (--pinned is on by default here): samples/s and
time to the success target, ratios against sync; the trainer's busy share and the share of the
tokens its devices generated.

    jaxrl bench multiplex [--warmup-dir runs/long_tail/checkpoints] [--seeds 3 --rl-steps 10]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import _rl_compare as compare  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "long_tail_cpu.yaml"
VARIANTS = ["sync", "sync+multiplex", "partial", "partial+multiplex", "async",
            "async+multiplex"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    compare.add_arguments(p, config=CONFIG, rl_steps=10, target=0.15, window=4,
                          variants=VARIANTS)
    p.add_argument("--in-process", dest="pinned", action="store_false",
                   help="run in this process, unpinned (the trainer's and the engine's "
                        "devices are then the same cores: nothing to multiplex)")
    p.set_defaults(pinned=True)
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="jaxrl-bench-"))
    try:
        base = compare.warm_checkpoint(args, work)
        results = compare.run_all(base, work, args)
        compare.report(results, args.save)
        if not any(isinstance(runs, list) and runs for runs in results.values()):
            raise SystemExit("every variant failed")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
