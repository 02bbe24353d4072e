"""The GPU campaign's engine-loop figure (bench/gpu.py, decode section): an engine step as the
orchestrator runs it, every slot decoding (admission over, nothing else in the loop), against
the decode program alone at the same held length (`decode`'s one-step dispatch). The difference
is the loop's host work that the device's step does not hide: planning, the page table,
dispatch, reading tokens back, streaming them. And the admit section's RL wave through the
orchestrator."""

from __future__ import annotations

import time

import numpy as np

from serving.core.orchestrator import Orchestrator
from serving.runner.sampling import SamplingParams


def loop_step(engine, params, prompt_len: int, seconds: float = 2.0, window_s: float = 0.1,
              deadline_s: float = 300.0) -> dict:
    """Milliseconds per engine step while every slot decodes, and the mean tokens a slot held:
    over windows of `window_s` in which every step ran every slot (none prefilling or done),
    `seconds` of them in all, or as many as the samples' length allows."""
    slots = engine.cfg.max_concurrent_decodes
    sampling = SamplingParams(temperature=1.0, max_tokens=engine.cfg.max_len - prompt_len - 1)
    totals = {"seconds": 0.0, "steps": 0, "held": 0, "busy": 0}
    with Orchestrator(engine, params, eos_id=None) as o:
        streams = [o.submit(list(range(3, 3 + prompt_len)), sampling) for _ in range(slots)]
        end = time.monotonic() + deadline_s
        while totals["seconds"] < seconds and time.monotonic() < end:
            before, t0 = o.metrics(), time.perf_counter()
            time.sleep(window_s)
            after, t1 = o.metrics(), time.perf_counter()
            tokens = after["generated_tokens"] - before["generated_tokens"]
            # every slot decoding: no prefill, a token for each slot at each step (a step may
            # run its slots in two batches: `steps` counts batches, tokens count slots)
            if (tokens >= 5 * slots and tokens % slots == 0
                    and after["prefill_chunks"] == before["prefill_chunks"]):
                totals["seconds"] += t1 - t0
                totals["steps"] += tokens // slots
                totals["busy"] += after["busy_slot_steps"] - before["busy_slot_steps"]
                totals["held"] += after["held_tokens"] - before["held_tokens"]
            elif totals["steps"] and not tokens:      # every sample done
                break
        for stream in streams:
            stream.cancel()
    if not totals["steps"]:
        raise TimeoutError(f"no window of {window_s} s ran every slot within {deadline_s} s")
    return {"engine_step_ms": totals["seconds"] * 1e3 / totals["steps"],
            "held_mean": totals["held"] / totals["busy"], "engine_steps": totals["steps"]}


def admit(engine, params, waves: int = 3, prompts: int = 32, n: int = 8,
          prompt_len: int = 8, max_tokens: int = 6) -> dict:
    """An RL step's requests through the orchestrator: `prompts` requests of `n` samples of
    `max_tokens` tokens (no EOS), all submitted at once, as the actor does; per wave: its time,
    the engine's decode steps and how full they ran. Against `decode`'s device step time, the
    difference is the engine loop's host work per request and per step."""
    rng = np.random.default_rng(0)
    sampling = SamplingParams(temperature=1.0, max_tokens=max_tokens, n=n, seed=0)
    with Orchestrator(engine, params) as o:
        def wave():
            streams = [o.submit(rng.integers(3, 200, size=prompt_len).tolist(), sampling)
                       for _ in range(prompts)]
            for stream in streams:
                stream.result()
        wave()                                   # every program ran once
        before, t0 = o.metrics(), time.perf_counter()
        for _ in range(waves):
            wave()
        seconds, after = (time.perf_counter() - t0) / waves, o.metrics()
    steps = (after["steps"] - before["steps"]) / waves
    busy = (after["busy_slot_steps"] - before["busy_slot_steps"]) / waves
    slots = engine.cfg.max_concurrent_decodes
    return {"wave_ms": seconds * 1e3, "samples_per_s": prompts * n / seconds,
            "tokens_per_s": prompts * n * max_tokens / seconds, "decode_steps": steps,
            "ms_per_decode_step": seconds * 1e3 / max(steps, 1),
            "slots_busy_fraction": busy / max(steps * slots, 1)}
