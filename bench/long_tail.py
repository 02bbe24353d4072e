"""Long-tailed RL: sync, sync with partial rollouts, and async (fifo and longest-first
admission) on the countdown task: samples/s and time to a target success rate as ratios against
sync; and the paged decode step at the runs' mean held length l against a cache sized l.

Every variant starts from the same warm-up checkpoint with the same config, hardware and sample
budget, one after the other in this process (bench/_rl_compare.py). The decode comparison is
bench/paged_decode.py's, on the same model shape and slot count, at the mean number of tokens a
busy slot held during the async run (the last variant's without one), with max_len 16x that.

    jaxrl bench long_tail --rl-steps 60 --target 0.5 [--warmup-dir runs/long_tail/checkpoints]
    (or: .venv/bin/python bench/long_tail.py ...)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import _rl_compare as compare  # noqa: E402
import paged_decode  # noqa: E402
from flax import nnx  # noqa: E402

from jaxrl.config import load_run_config  # noqa: E402
from jaxrl.models import Transformer  # noqa: E402
from jaxrl.recipe import model_config  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "long_tail_cpu.yaml"


def decode_ratio(args, held: int) -> dict:
    """paged_decode.measure at held length `held` on the run's model shape and slots."""
    cfg = load_run_config(args.config, args.overrides)
    mcfg = model_config(cfg)
    mcfg = dataclasses.replace(mcfg, max_seq_len=max(mcfg.max_seq_len, 16 * (held + 16)))
    measure_args = argparse.Namespace(slots=cfg.rl.engine.max_concurrent_decodes, steps=16,
                                      page_size=16, page_buckets=4, repeats=5, rounds=3)
    return paged_decode.measure(Transformer(mcfg, rngs=nnx.Rngs(0)), measure_args, held)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    compare.add_arguments(p, config=CONFIG, rl_steps=60, target=0.5, window=10,
                          variants=list(compare.VARIANTS))
    p.add_argument("--keep", action="store_true",
                   help="keep the runs' directories (e.g. the sync runs for jaxrl bench calibrate)")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="jaxrl-bench-"))
    base = compare.warm_checkpoint(args, work)
    results = compare.run_all(base, work, args)
    compare.report(results, args.save)
    if args.pinned:         # the decode comparison below runs in this process, unpinned
        _finish(work, args.keep)
        return
    ran = {name: runs for name, runs in results.items() if not isinstance(runs, str) and runs}
    if not ran:
        raise SystemExit("every variant failed")
    runs = ran.get("async") or list(ran.values())[-1]
    held = round(sum(r["held_tokens_mean"] for r in runs) / len(runs))
    d = decode_ratio(args, held)
    print(f"decode at mean held length l={held} (max_len {d['max_len']}): paged "
          f"{d['paged_step_ms']:.3f} ms, contiguous sized l {d['contiguous_exact_step_ms']:.3f} "
          f"ms: paged {d['paged_vs_exact']:.2f}x; contiguous sized max_len "
          f"{d['contiguous_max_len_step_ms']:.3f} ms: {d['max_len_vs_paged']:.1f}x paged")
    print(json.dumps(d))
    _finish(work, args.keep)


def _finish(work: Path, keep: bool) -> None:
    if keep:
        print(f"runs kept in {work}", file=sys.stderr)   # the last line stays the JSON
    else:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
