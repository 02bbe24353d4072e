"""LoRA against full fine-tuning in RL: samples/s, time to a target success rate and the final
success rate, from one warm-up.

The demo recipe's RL from the same warm-up checkpoint (which trains every weight: a random
initialisation has nothing to adapt), once training every weight and once training rank-8
adapters on every projection with the base frozen, each with the same seeds and sample budget,
one after the other in one process (bench/_rl_compare.py).

    jaxrl bench lora_rl [--rl-steps 400] [--seeds 2] [--variants full lora-r8]
    (or: .venv/bin/python bench/lora_rl.py ...)
"""

from __future__ import annotations

import argparse

import _rl_compare as compare


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    compare.add_arguments(p, config=compare.DEMO_CONFIG, rl_steps=400, target=0.35, window=20,
                          variants=["full", "lora-r8"])
    p.set_defaults(seeds=2)
    args = p.parse_args(argv)
    compare.compare_variants(args)


if __name__ == "__main__":
    main()
