"""Measured op costs for bench/simulate.py, from a pinned core and pinned sync RL runs.

The simulator's roofline formulas describe accelerators; this replaces them with what a run's
pieces cost here, so that its prediction can be checked against a measured run (issue: async
against sync on cores of their own):
- decode: the engine's decode step (the run's model and EngineConfig, one step per dispatch
  and a host sync after each, as the engine loop runs it), timed on `--core` alone: every slot
  busy at several held lengths, fitted as fixed ms + us per held token, and the fixed cost at
  each of the engine's smaller row counts (a step with few busy slots decodes fewer rows);
- prefill: one full prefill call (its rows of one chunk), per prompt token;
- train and weight push: from pinned sync runs' metrics.jsonl (`--run-dir`, their steps
  pooled): each RL step's train time, fitted as a cost per microbatch (its packed rows, however
  full) plus a cost per token (prompt and completion, as the simulator counts them), and the
  weight transfer (sync) and in-flight swap (async) per update;
- the groups the runs dropped as they finished (`rl.filter_zero_advantage`: every reward
  equal), which the actor regenerates;
- the trainer's host work per generated sample (receiving it, its reward, packing): the sync
  runs' process CPU seconds beyond their train steps, over the samples they generated;
- serving: the same decode as a pinned `jaxrl serve` process runs it (its engine loop, the
  token streams, gRPC), every slot busy with samples of one length, streamed to a client on
  `--load-core` as an RL trainer reads them: its wall time over what the decode and prefill
  costs above predict for the steps it ran (`serve_overhead`);
- contention: a decode step timed on `--core` while another process decodes on
  `--load-core`, over the same step alone, the median of 5 pairs (the two sides of an async
  run share the machine's memory and caches; measured with decode on both cores, not with a
  train step);
- the actor's bound on samples ahead of the trainer, as jaxrl/rollout/actor.py sets it;
- the workload: the output length of each of `--problems` problems as the run's actor draws
  them (`rl.completion_length=answer`: a sample is as long as its answer, plus its EOS), the
  mean prompt length, slots, batch, group size and max lag.

    jaxrl bench calibrate --run-dir /tmp/cal/sync_seed0 /tmp/cal/sync_seed1 --out costs.json
    jaxrl bench simulate --calibration costs.json --steps 10 --modes sync async
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "long_tail_cpu.yaml"


def pin(core: int) -> None:
    """This process on `core` alone, before JAX starts (XLA:CPU sizes its pools from it)."""
    os.sched_setaffinity(0, {core})
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def decode_step_s(engine, params, rows: int, held: int, steps: int = 8) -> float:
    """Median seconds of a decode step of `rows` busy slots holding `held` tokens each."""
    import numpy as np

    from serving.runner.engine import SlotBatch
    from serving.runner.sampling import SamplingParams

    s = engine.cfg.max_concurrent_decodes
    sampling = [SamplingParams(temperature=1.0)] * s
    width = engine.cfg.table_width(held + steps)
    table = 1 + np.arange(s * width, dtype=np.int32).reshape(s, width) % (engine.num_pages - 1)
    times = []
    for _ in range(3):
        state = engine.insert(engine.init_decode_state(), SlotBatch(
            list(range(s)), [held] * s, [3] * s, [1] * s, sampling, [0] * s))
        for i in range(steps):
            t0 = time.perf_counter()
            state, tokens, _ = engine.generate_steps(params, state, table[:rows], 1,
                                                     slots=list(range(rows)))
            np.asarray(tokens)
            if i:                             # the first of each round loads the program
                times.append(time.perf_counter() - t0)
    return statistics.median(times)


def decode_costs(engine, params, held: list[int]) -> dict:
    """A decode step's cost per held token (least squares over `held` lengths, every slot
    busy) and its fixed cost at each of the engine's row counts (S/16, S/4, S of S slots: a
    step decodes the smallest that holds its busy slots)."""
    import numpy as np

    s = engine.cfg.max_concurrent_decodes
    points = [(s * h, decode_step_s(engine, params, s, h)) for h in held]
    x, y = np.array([p[0] for p in points], float), np.array([p[1] for p in points])
    slope, fixed = np.polyfit(x, y, 1)
    low = min(held)
    by_rows = {r: 1e3 * (decode_step_s(engine, params, r, low) - slope * r * low)
               for r in engine.cfg.row_sizes if r < s}
    return {"decode_ms": 1e3 * float(fixed), "decode_us_per_held": 1e6 * float(slope),
            "decode_ms_by_rows": {**by_rows, s: 1e3 * float(fixed)},
            "points": [{"held_tokens": int(a), "step_ms": 1e3 * float(b)} for a, b in points]}


def prefill_us_per_token(engine, params) -> float:
    import numpy as np

    rows, chunk = engine.cfg.max_prefill_rows, engine.cfg.buckets[0]
    width = engine.cfg.prefill_width(chunk)
    table = 1 + np.arange(rows * width, dtype=np.int32).reshape(rows, width) % (
        engine.num_pages - 1)
    tokens = np.full((rows, chunk), 3, np.int32)
    state, times = engine.init_decode_state(), []
    for _ in range(6):
        t0 = time.perf_counter()
        state, logits = engine.prefill(params, state, tokens, [0] * rows, [chunk] * rows, table)
        np.asarray(logits)
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times[1:]) / (rows * chunk)


def workload(cfg, model_cfg, problems: int) -> dict:
    """Output lengths and mean prompt length of the run's problems, drawn as its actor does."""
    import numpy as np

    from jaxrl.models.tokenizer import prompt_ids
    from jaxrl.recipe import build_task

    if cfg.rl.completion_length != "answer":
        raise SystemExit(f"rl.completion_length={cfg.rl.completion_length!r}: the lengths would "
                         "depend on the model; calibrate a length-controlled workload "
                         "(rl.completion_length=answer, e.g. configs/long_tail_cpu.yaml)")
    task, tokenizer = build_task(cfg, model_cfg)
    lengths, prompts = [], []
    for index in range(problems):
        problem = task.sample(np.random.default_rng((cfg.train.seed, index, 1)))
        prompts.append(len(prompt_ids(tokenizer, problem.prompt)))
        lengths.append(min(len(tokenizer.encode(problem.answer)) + 1, cfg.rl.max_new_tokens))
    return {"lengths": lengths, "prompt_len": round(statistics.mean(prompts))}


def contention(engine, params, core: int, load_core: int, argv: list[str],
               rounds: int = 5) -> float:
    """A decode step's time beside another process decoding on `load_core`, over its time
    alone: the median ratio of `rounds` pairs, the load stopped (SIGSTOP) for each alone."""
    import signal
    import subprocess

    rows, held = engine.cfg.max_concurrent_decodes, 128
    load = subprocess.Popen([sys.executable, __file__, "--load", *argv, "--core",
                             str(load_core)], stdout=subprocess.PIPE, text=True)
    try:
        if load.stdout.readline().strip() != "ready":
            raise SystemExit("the contention load process did not start")
        ratios = []
        for _ in range(rounds):
            load.send_signal(signal.SIGSTOP)
            alone = decode_step_s(engine, params, rows, held)
            load.send_signal(signal.SIGCONT)
            ratios.append(decode_step_s(engine, params, rows, held) / alone)
    finally:
        load.kill()
        load.wait()
    return max(1.0, statistics.median(ratios))    # below 1: noise (a load cannot speed it up)


def serve_overhead(cfg, engine, costs: dict, checkpoints: Path, core: int, load_core: int,
                   length: int = 256) -> float:
    """A `jaxrl serve` process on `core` decoding every slot's sample of `length` tokens for a
    client on `load_core`: its wall time over the predicted (decode steps at the held tokens
    its metrics count, the prefills)."""
    import tempfile

    from jaxrl.rollout.local_servers import LocalServers
    from serving.fleet.client import RemoteGeneration
    from serving.runner.sampling import SamplingParams

    s, group = engine.cfg.max_concurrent_decodes, cfg.rl.group_size
    prompt = [3] * round(costs["prompt_len"])
    sampling = SamplingParams(temperature=1.0, max_tokens=length, n=group, stop_at_eos=False)
    os.sched_setaffinity(0, {load_core})          # the client reads as the trainer would
    with tempfile.TemporaryDirectory() as tmp:
        servers = LocalServers(checkpoints, engine.cfg, engine.model_cfg, [[core]],
                               Path(tmp), log=lambda message: None)
        try:
            servers.wait_ready(600)
            client = RemoteGeneration(servers.addresses[0], token=servers.token,
                                      stream_interval_ms=cfg.rl.generation.stream_interval_ms)
            try:
                for _ in range(2):                # the first round warms the streams up
                    before, t0 = client.metrics(), time.perf_counter()
                    streams = [client.submit(prompt, sampling) for _ in range(s // group)]
                    for stream in streams:
                        stream.result()
                    wall, after = time.perf_counter() - t0, client.metrics()
            finally:
                client.close()
        finally:
            servers.close()
            os.sched_setaffinity(0, {core})
    steps = after["steps"] - before["steps"]
    held = after["held_tokens"] - before["held_tokens"]
    predicted = (steps * costs["decode_ms"] / 1e3 + held * costs["decode_us_per_held"] / 1e6
                 + s * len(prompt) * costs["prefill_us_per_token"] / 1e6)
    return wall / predicted


def run_costs(run_dirs: list[Path], prompt_len: int, batch: int) -> dict:
    """Train costs, dropped groups, host work and weight push from pinned sync runs, their
    steps pooled (each run's first RL step, which compiles, left out)."""
    import numpy as np

    steps, generated, dropped, host_cpu_s, logged, updates = [], 0, 0, 0.0, [], []
    for run_dir in run_dirs:
        rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
        rows = [r for r in rows if "step_s" in r]
        if len(rows) < 3:
            raise SystemExit(f"{run_dir}/metrics.jsonl has fewer than 2 RL steps after the "
                             "first")
        first, rows = rows[0], rows[1:]
        steps += rows
        generated += rows[-1]["samples_generated"] - first["samples_generated"]
        dropped += rows[-1]["dropped_zero_advantage"] - first["dropped_zero_advantage"]
        host_cpu_s += sum(b["process_cpu_s"] - a["process_cpu_s"] - b["step_s"]
                          for a, b in zip([first, *rows], rows))
        # A launched server logs each update it takes (the trainer's metrics leave a remote
        # server's transfer at 0): "weights version N streamed: transfer X ms, pause Y ms".
        logged += [tuple(map(float, m)) for log in run_dir.glob("launched_server_*.log")
                   for m in re.findall(r"streamed: transfer ([0-9.]+) ms, pause ([0-9.]+) ms",
                                       log.read_text())]
        updates += [(r.get("update_transfer_ms", 0.0), r.get("update_pause_ms", 0.0))
                    for r in rows]
    # step_s = microbatches x ms + tokens x us, least squares; a negative cost is refitted as 0.
    x = np.array([[r["microbatches"], r["trained_tokens"] + prompt_len * batch]
                  for r in steps], float)
    y = np.array([r["step_s"] for r in steps])
    per_microbatch, per_token = np.linalg.lstsq(x, y, rcond=None)[0]
    if min(per_microbatch, per_token) < 0:
        keep = int(per_token > per_microbatch)
        fit = float(np.linalg.lstsq(x[:, keep:keep + 1], y, rcond=None)[0][0])
        per_microbatch, per_token = (0.0, fit) if keep else (fit, 0.0)
    transfer, pause = zip(*(logged or updates))
    return {"train_us_per_token": 1e6 * per_token, "train_ms_per_microbatch": 1e3 * per_microbatch,
            "drop_groups": dropped / generated if generated else 0.0,
            "trainer_host_ms_per_sample": 1e3 * host_cpu_s / generated if generated else 0.0,
            "reload_s": statistics.median(transfer) / 1e3, "swap_ms": statistics.median(pause),
            "train_steps": len(steps)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default=str(CONFIG))
    p.add_argument("--run-dir", type=Path, nargs="+", help="pinned sync runs of the config "
                   "(rl.generation.launch=1), their steps pooled; required")
    cores = sorted(os.sched_getaffinity(0))
    p.add_argument("--core", type=int, default=cores[-1],
                   help="the core to time the engine on (a pinned run's server core)")
    p.add_argument("--load-core", type=int, default=cores[0],
                   help="the other side's core, loaded while contention is measured")
    p.add_argument("--load", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--held", type=int, nargs="+", default=[32, 128, 512, 1024],
                   help="tokens each slot holds, per decode timing")
    p.add_argument("--problems", type=int, default=20000)
    p.add_argument("--out", default="calibration.json")
    p.add_argument("overrides", nargs="*", help="config overrides, as the run was given them")
    args = p.parse_args(argv)
    if args.run_dir is None and not args.load:
        p.error("--run-dir is required")
    pin(args.core)
    import logging

    from flax import nnx

    from jaxrl.config import load_run_config
    from jaxrl.models import Transformer, split_params
    from jaxrl.recipe import model_config
    from jaxrl.rollout.actor import ahead_bound
    from jaxrl.rollout.generation import engine_config
    from serving.runner.engine import Engine

    # The engine compiles what it runs as it goes (a few programs, not every shape it could).
    logging.getLogger("serving.runner.programs").setLevel(logging.ERROR)
    cfg = load_run_config(args.config, args.overrides)
    model_cfg = model_config(cfg)
    engine = Engine(model_cfg, engine_config(cfg, model_cfg))
    params = engine.prepare_params(split_params(Transformer(model_cfg, rngs=nnx.Rngs(0)))[1])
    if args.load:           # contention's other side: decode until killed
        decode_step_s(engine, params, engine.cfg.max_concurrent_decodes, 128)
        print("ready", flush=True)
        while True:
            decode_step_s(engine, params, engine.cfg.max_concurrent_decodes, 128)
    work = workload(cfg, model_cfg, args.problems)
    decode = decode_costs(engine, params, args.held)
    out = {**{k: v for k, v in decode.items() if k != "points"},
           "prefill_us_per_token": prefill_us_per_token(engine, params),
           **run_costs(args.run_dir, work["prompt_len"], cfg.rl.batch_size), **work,
           "slots": cfg.rl.engine.max_concurrent_decodes, "batch": cfg.rl.batch_size,
           "group_size": cfg.rl.group_size,
           "pack_len": cfg.rl.pack_len, "microbatch_rows": cfg.rl.microbatch_rows,
           "max_segments": cfg.rl.max_segments,
           "max_lag": cfg.rl.max_lag, "accelerators": 2, "gen_fraction": 0.5, "split": True,
           "max_ahead": ahead_bound(cfg.rl.batch_size, cfg.rl.engine.max_concurrent_decodes),
           "contention": contention(engine, params, args.core, args.load_core,
                                    ["--config", args.config, *args.overrides]),
           "decode_points": decode["points"], "core": args.core}
    out["serve_overhead"] = serve_overhead(cfg, engine, out, args.run_dir[0] / "checkpoints",
                                           args.core, args.load_core)
    Path(args.out).write_text(json.dumps(out))
    shown = {k: v for k, v in out.items() if k not in ("lengths", "decode_points")}
    print(json.dumps(shown, indent=1))
    print("decode step's fixed ms by busy rows: " + ", ".join(
        f"{r}: {ms:.2f}" for r, ms in decode["decode_ms_by_rows"].items()))
    print("decode step (ms) by held tokens: " + ", ".join(
        f"{d['held_tokens']}: {d['step_ms']:.2f}" for d in decode["points"]))
    print(f"wrote {args.out}; then: jaxrl bench simulate --calibration {args.out} --steps 10 "
          f"--modes sync async", file=sys.stderr)


if __name__ == "__main__":
    main()
