"""Async (PipelineRL) against sync RL: samples/s and time to a target success rate.

Async (in-flight weight updates) and sync (conventional) RL with the same config, the same
warm-up checkpoint, the same hardware and the same sample budget, run one after the other in
one process (bench/_rl_compare.py). Prints the samples/s ratio and the time-to-target ratio.
`--variants` adds others: partial (sync with partial rollouts), async+longest_first.

    jaxrl bench async_vs_sync --config configs/demo_cpu.yaml --rl-steps 400 --target 0.35
    (or: .venv/bin/python bench/async_vs_sync.py ...)
"""

from __future__ import annotations

import argparse

import _rl_compare as compare


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    compare.add_arguments(p, config=compare.DEMO_CONFIG, rl_steps=400, target=0.35, window=20,
                          variants=["sync", "async"])
    args = p.parse_args(argv)
    compare.compare_variants(args)


if __name__ == "__main__":
    main()
