"""Speculative decoding of the long tail: the engine alone decoding R rows of countdown answers
with and without speculation, and the pinned long-tail RL task in sync and async with and
without it, side by side in one run.

Engine: the long-tail warm-up model (bench/_rl_compare.py's checkpoint) serves R rows, groups
of up to 8 samples of countdown problems with long answers (every sample of a problem writes
the same answer, as in RL), at temperature 1, for `--tokens` tokens each; tokens/s over the
whole generation with speculation off and with each drafter, alternating over `--rounds`
(medians). Each drafter's second pass of the same prompts drafts from the first's rollouts
too (an RL run drawing a problem again). Compiles, and the engine's start-up timing of its
programs, are done before the clock starts.

RL (`--rl`): bench/_rl_compare.py's variants sync, sync+speculative, async, async+speculative
(`--pinned`: trainer and server on cores of their own, as `jaxrl bench long_tail --pinned`).

    jaxrl bench speculative [--warmup-dir runs/long_tail/checkpoints] [--rows 1 4 16 64]
        [--rl --pinned --seeds 3 --rl-steps 10 --window 4 --target 0.15 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import _rl_compare as compare  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl.models import split_params  # noqa: E402
from jaxrl.models.tokenizer import prompt_ids  # noqa: E402
from jaxrl.rl.tasks.countdown import BITS  # noqa: E402
from jaxrl.trainer.warmup import restore_for_eval  # noqa: E402
from serving.core.orchestrator import Orchestrator  # noqa: E402
from serving.runner.engine import Engine, EngineConfig  # noqa: E402
from serving.runner.sampling import SamplingParams  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "long_tail_cpu.yaml"
RL_VARIANTS = ["sync", "sync+speculative", "async", "async+speculative"]
GROUP = 8


def tail_prompts(task, tokenizer, rows: int, tokens: int) -> list[tuple[list[int], int]]:
    """(prompt ids, samples) for `rows` rows: groups of up to GROUP samples of countdown
    problems whose answers are longer than `tokens`."""
    steps = -(-tokens // 9) + 1             # an answer of n steps is 9n - 1 tokens
    rng = np.random.default_rng(0)
    out, left = [], rows
    while left:
        n = min(GROUP, left)
        a = int(rng.integers(0, 2 ** BITS - steps))
        out.append((prompt_ids(tokenizer, task.problem(a, steps).prompt), n))
        left -= n
    return out


def decode(model, prompts, tokens: int, speculative: str, passes: int = 2) -> list[dict]:
    """Each pass's tokens/s and speculation counters, one engine and drafter for all passes
    (compiled before the first)."""
    rows = sum(n for _, n in prompts)
    longest = max(len(p) for p, _ in prompts)
    slots = rows            # the tail as its own batch: no padding rows
    cfg = EngineConfig(max_concurrent_decodes=slots, max_len=longest + tokens + 1,
                       max_prefill_length=longest, prefill_chunk=32, prefill_budget=256,
                       speculative=speculative, sampling_features=())
    engine = Engine(model.cfg, cfg)
    engine.compile()
    out = []
    with Orchestrator(engine, split_params(model)[1]) as o:
        # served once the engine loop has timed its programs (speculation.py: measure)
        o.generate(prompts[0][0], SamplingParams(temperature=0.0, max_tokens=1))
        for i in range(passes):
            before = o.metrics()
            t0 = time.perf_counter()
            streams = [o.submit(p, SamplingParams(temperature=1.0, max_tokens=tokens, n=n,
                                                  seed=i))
                       for p, n in prompts]
            made = sum(len(s.tokens) for stream in streams for s in stream.result())
            seconds = time.perf_counter() - t0
            after = o.metrics()
            delta = {k: after.get(k, 0) - before.get(k, 0)
                     for k in ("spec_decode_num_drafts", "spec_decode_num_accepted_tokens",
                               "spec_decode_verify_steps", "steps")}
            out.append({"tokens_per_s": made / seconds, "steps": delta["steps"],
                        "verify_steps": delta["spec_decode_verify_steps"],
                        "acceptance_length": 1 + delta["spec_decode_num_accepted_tokens"]
                        / max(delta["spec_decode_num_drafts"], 1)})
    return out


def engine_section(args, base: Path) -> dict:
    model, task, tokenizer, _ = restore_for_eval(base)
    kinds = ["off", *args.drafters]
    results = {}
    for rows in args.rows:
        prompts = tail_prompts(task, tokenizer, rows, args.tokens)
        runs = {kind: [] for kind in kinds}
        for r in range(args.rounds):
            for kind in (kinds if r % 2 == 0 else kinds[::-1]):
                runs[kind].append(decode(model, prompts, args.tokens, kind))
        row = {}
        for kind, rounds in runs.items():
            for p in range(2):
                row[f"{kind}_pass{p + 1}"] = {
                    k: statistics.median(r[p][k] for r in rounds)
                    for k in ("tokens_per_s", "acceptance_length", "steps", "verify_steps")}
        results[rows] = row
        off = row["off_pass2"]["tokens_per_s"]
        print(f"{rows:>3} rows: off {off:8.1f} tok/s; " + "; ".join(
            f"{kind} {row[f'{kind}_pass{p}']['tokens_per_s']:8.1f} tok/s "
            f"({row[f'{kind}_pass{p}']['tokens_per_s'] / off:.2f}x, "
            f"{row[f'{kind}_pass{p}']['acceptance_length']:.2f} tokens a verify, pass {p})"
            for kind in args.drafters for p in (1, 2)), flush=True)
    return results


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    compare.add_arguments(p, config=CONFIG, rl_steps=10, target=0.15, window=4,
                          variants=RL_VARIANTS)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64],
                   help="rows decoding at once (the tail's size)")
    p.add_argument("--tokens", type=int, default=256, help="tokens each row writes")
    p.add_argument("--drafters", nargs="+", default=["suffix", "ngram"],
                   choices=["suffix", "ngram"], help="drafters against speculation off")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds (medians)")
    p.add_argument("--rl", action="store_true", help="also the RL comparison (--variants)")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="jaxrl-bench-"))
    try:
        base = compare.warm_checkpoint(args, work)
        out = {"engine": engine_section(args, base)}
        if args.rl:
            results = compare.run_all(base, work, args)
            compare.report(results, args.save)
            out["rl"] = {name: runs if isinstance(runs, str) else compare.aggregate(runs)
                         for name, runs in results.items() if runs}
        print(json.dumps(out))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
