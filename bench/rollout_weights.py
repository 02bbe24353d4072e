"""int8 rollout weights against the model's own in RL: the sampler/trainer log-prob gap, the
success the demo reaches, samples/s, from one warm-up.

The demo recipe's RL from the same warm-up checkpoint, once with the engine holding the
trainer's weights as they are and once holding them int8 (`rl.generation.weights=int8`: each
layer projection with a scale per output channel, quantized by the trainer at every publish),
with the same seeds and sample budget, one after the other in one process
(bench/_rl_compare.py). Add `int8-rollouts+icepop` to mask the tokens whose ratio strays, or
`fp8-kv` for the engine's KV cache in float8 e4m3 (`rl.engine.kv_cache_dtype=fp8`).

    jaxrl bench rollout_weights [--rl-steps 400] [--seeds 1]
    (or: .venv/bin/python bench/rollout_weights.py ...)
"""

from __future__ import annotations

import argparse

import _rl_compare as compare


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    compare.add_arguments(p, config=compare.DEMO_CONFIG, rl_steps=400, target=0.35, window=20,
                          variants=["full", "int8-rollouts"])
    p.set_defaults(seeds=1)
    args = p.parse_args(argv)
    compare.compare_variants(args)


if __name__ == "__main__":
    main()
