"""A discrete-event simulation of RL on a 128-accelerator cluster: conventional sync RL, sync with
partial rollouts, PipelineRL-style async, and async with StreamRL-style length-aware admission.
Speedups over sync and accelerator utilisation side by side, with the papers' reported figures.

Assumptions (each a flag; the defaults describe a 7B-class model on H100s):
- Generation instances hold the whole model on one accelerator each and decode all their
  sequences together, one token per sequence per step. A decode step is memory-bound: it reads
  the weights once and every held token's KV once, at `--hbm-gbps` x `--hbm-efficiency`; an
  instance holds at most `--slots` sequences (KV capacity is not modelled beyond that). Prefill
  is compute-bound at `--mfu` of `--peak-tflops` (2 x params FLOPs per prompt token).
- Training costs 6 x params FLOPs per token (prompt and completion) at `--mfu`, spread evenly
  over the trainer's accelerators; a step trains exactly `--batch` samples.
- Output lengths are log-normal (`--median-len`, `--sigma`), clipped at `--max-len`: most
  samples short, a few percent at the limit.
- sync: all accelerators generate a step's batch (prompts spread evenly), wait for its longest
  sample, then all train, then the new weights are loaded (`--reload-s`).
- partial: as sync, but generation keeps every slot full and stops as soon as `--batch`
  samples are done; unfinished samples keep their tokens and resume after the train phase.
- async (PipelineRL): `--gen-fraction` of the accelerators (by default the split that gives the
  most samples/s, as a deployment would be sized) generate without stopping, the rest
  train as soon as a batch is done; new weights reach the generators in flight (a
  `--swap-ms` pause per update); samples more than `--max-lag` steps old are dropped.
- async+length: async, admitting the longest predicted request first on each instance
  (StreamRL's skewness-aware scheduling; the prediction is the true length times log-normal
  noise of `--predict-sigma`), so the tail starts early.
- sync+multiplex, partial+multiplex (SeamlessFlow's spatiotemporal multiplexing, jaxrl's
  rl.multiplex): async's split of the accelerators, the trainer's generating beside the others
  while it waits for its batch; in partial, when the batch is ready their unfinished samples
  move to the other instances (prefilled again there with the tokens they reached) and they
  train.
- Measured costs (bench/calibrate.py's, `--calibration`) replace the formulas: a decode step's
  fixed cost by the rows it decodes plus a cost per held token; a packed trainer's step as a
  cost per microbatch plus one per token (`--train-ms-per-microbatch`, samples packed first
  fit into `--pack-len` rows); groups dropped as they finish (`--drop-groups`, jaxrl's
  zero-advantage filter) and generated again; the trainer's host work per sample
  (`--trainer-host-ms-per-sample`), free while a sync trainer waits, taken from its steps in
  async; `--contention`, the factor by which both sides' steps slow while both compute; and
  `--serve-overhead`, a served engine's steps over the bare engine's measured costs.
Measured figures (e.g. this project's decode step on an accelerator) enter through the flags;
none of the defaults was measured here, and the result is a model, not a measurement.

    jaxrl bench simulate [--accelerators 128 --steps 40 ...]
    (or: .venv/bin/python bench/simulate.py ...)
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
from pathlib import Path

import numpy as np

PAPERS = {"PipelineRL (async vs conventional, 128 H100)": "~2x",
          "StreamRL (disaggregated, skewness-aware)": "up to 2.66x",
          "AReaL (fully async)": "up to 2.77x",
          "verl fully-async": "2.35-2.67x"}


@dataclasses.dataclass
class Cluster:
    accelerators: int
    params_b: float          # billions of parameters
    kv_kib_per_token: float
    hbm_gbps: float
    hbm_efficiency: float
    peak_tflops: float
    mfu: float
    slots: int
    prompt_len: int
    swap_ms: float
    reload_s: float
    # Measured op costs (bench/calibrate.py), each replacing its roofline formula when set:
    # a decode step's fixed cost and its cost per held token, prefill and training per token.
    decode_ms: float | None = None
    decode_us_per_held: float = 0.0
    # The fixed cost by the rows a step decodes (an engine decodes the smallest of its row
    # counts that holds the busy sequences); None: decode_ms at any count.
    decode_ms_by_rows: dict[int, float] | None = None
    prefill_us_per_token: float | None = None
    train_us_per_token: float | None = None
    # A packed trainer's step (jaxrl's): samples first-fit into rows of `pack_len` tokens (at most
    # `max_segments` each), `microbatch_rows` rows per microbatch; each microbatch costs
    # `train_ms_per_microbatch` beyond the per-token cost, however full its rows are.
    train_ms_per_microbatch: float | None = None
    pack_len: int = 0
    microbatch_rows: int = 0
    max_segments: int = 0
    # Work on the trainer's own cores per sample generated (receiving it, its reward, packing):
    # while the trainer waits (sync) it is free, beside a train step (async) it is not.
    trainer_host_ms_per_sample: float = 0.0
    # How much slower each side's steps run while the other side computes too (shared memory
    # and caches; 1 on separate machines): in async, all the time.
    contention: float = 1.0
    # A served engine's steps (its loop, token streams, RPCs) over the measured decode and
    # prefill costs.
    serve_overhead: float = 1.0

    @property
    def weight_bytes(self) -> float:
        return 2 * self.params_b * 1e9       # bf16

    def decode_step_s(self, held_tokens: float, rows: int) -> float:
        if self.decode_ms is not None:
            return self.fixed_ms(rows) / 1e3 + held_tokens * self.decode_us_per_held / 1e6
        bytes_read = self.weight_bytes + held_tokens * self.kv_kib_per_token * 1024
        return bytes_read / (self.hbm_gbps * 1e9 * self.hbm_efficiency)

    def fixed_ms(self, rows: int) -> float:
        """A measured decode step's fixed cost for `rows` busy sequences: that of the smallest
        row count measured that holds them (the largest, for more)."""
        by_rows = self.decode_ms_by_rows
        if not by_rows:
            return self.decode_ms
        holding = [r for r in by_rows if r >= rows]
        return by_rows[min(holding) if holding else max(by_rows)]

    def prefill_s(self, tokens: int) -> float:
        if self.prefill_us_per_token is not None:
            return tokens * self.prefill_us_per_token / 1e6
        return 2 * self.params_b * 1e9 * tokens / (self.peak_tflops * 1e12 * self.mfu)

    def train_s(self, lengths, accelerators: int) -> float:
        """One optimizer step over samples of these output lengths."""
        tokens = sum(self.prompt_len + n for n in lengths)
        if self.train_us_per_token is None:
            return 6 * self.params_b * 1e9 * tokens / (self.peak_tflops * 1e12 * self.mfu
                                                       * accelerators)
        seconds = tokens * self.train_us_per_token / 1e6
        if self.train_ms_per_microbatch is not None:
            seconds += self.microbatches(lengths) * self.train_ms_per_microbatch / 1e3
        return seconds / accelerators

    def microbatches(self, lengths) -> int:
        """Microbatches the samples pack into, first fit in order (as Grain's
        FirstFitPackIterDataset packs a jaxrl step's batch)."""
        free: list[int] = []        # tokens left in each row
        segments: list[int] = []
        for n in lengths:
            size = self.prompt_len + n - 1       # next-token pairs
            for i, room in enumerate(free):
                if room >= size and segments[i] < self.max_segments:
                    free[i] -= size
                    segments[i] += 1
                    break
            else:
                free.append(self.pack_len - size)
                segments.append(1)
        return -(-len(free) // self.microbatch_rows)


class Instance:
    """One generation accelerator: its running sequences advance one token per decode step."""

    def __init__(self, index: int, cluster: Cluster):
        self.index, self.c = index, cluster
        self.running: list[tuple[int, int]] = []   # heap of (finish step, sample id)
        self.step = 0                                # decode steps run so far
        self.admit_sum = 0                           # sum of admission steps of `running`
        self.time = 0.0                              # when `step` was reached
        self.busy_s = 0.0                            # time with at least one sequence
        self.slow = cluster.serve_overhead           # cost factor (and Cluster.contention)
        self.tokens = 0

    def held(self) -> float:
        b = len(self.running)
        return b * self.c.prompt_len + b * self.step - self.admit_sum

    def next_finish(self) -> float:
        if not self.running:
            return math.inf
        steps = self.running[0][0] - self.step
        b = len(self.running)
        mid_held = self.held() + b * steps / 2
        return self.time + steps * self.slow * self.c.decode_step_s(mid_held, b)

    def advance(self, until: float) -> None:
        """Runs decode steps up to time `until` (never past the next finish)."""
        if not self.running or until <= self.time:
            self.time = max(self.time, until)
            return
        to_finish = self.running[0][0] - self.step
        # The step time next_finish assumed (the held tokens at the interval's midpoint), so
        # that advancing to the next finish lands exactly on it.
        step_s = self.slow * self.c.decode_step_s(
            self.held() + len(self.running) * to_finish / 2, len(self.running))
        steps = min(int((until - self.time) / step_s + 1e-6), to_finish)
        self.busy_s += until - self.time
        self.tokens += steps * len(self.running)
        self.step += steps
        self.time = until

    def admit(self, sample: int, length: int, done_tokens: int = 0) -> None:
        """Starts `sample` with `length` output tokens, `done_tokens` of them already made."""
        self.time += self.slow * self.c.prefill_s(self.c.prompt_len + done_tokens)
        start = self.step - done_tokens
        heapq.heappush(self.running, (start + length, sample))
        self.admit_sum += start

    def pop_finished(self) -> list[int]:
        out = []
        while self.running and self.running[0][0] <= self.step:
            finish, sample = heapq.heappop(self.running)
            self.admit_sum -= finish - LENGTHS[sample]
            out.append(sample)
        return out


class Finishes:
    """The instances' next finish times, earliest first (a heap, updated lazily)."""

    def __init__(self, gens: list[Instance]):
        self.gens = gens
        self.rebuild()

    def rebuild(self) -> None:
        self.stamps = [0] * len(self.gens)
        self.heap = [(g.next_finish(), 0, g.index) for g in self.gens]
        heapq.heapify(self.heap)

    def update(self, g: Instance) -> None:
        self.stamps[g.index] += 1
        heapq.heappush(self.heap, (g.next_finish(), self.stamps[g.index], g.index))

    def first(self) -> tuple[Instance, float]:
        while self.heap[0][1] != self.stamps[self.heap[0][2]]:
            heapq.heappop(self.heap)
        when, _, index = self.heap[0]
        return self.gens[index], when


LENGTHS = np.zeros(0, int)      # output length of every sample, by sample id
DROPPED = np.zeros(0, bool)     # whether its group is dropped when it finishes (equal rewards)


def draw_lengths(rng, n: int, args) -> np.ndarray:
    """Output lengths: drawn from `args.lengths` (a measured workload's) when given, else
    log-normal; the `args.group_size` samples of a group share theirs (a length-controlled
    workload: every sample of a problem is as long as its answer)."""
    groups = -(-n // args.group_size)     # a group's samples answer one problem: one length
    if args.lengths:
        x = rng.choice(np.asarray(args.lengths, int), groups)
    else:
        x = np.clip(np.round(rng.lognormal(math.log(args.median_len), args.sigma, groups)), 1,
                    args.max_len).astype(int)
    return np.repeat(x, args.group_size)[:n]


def simulate(mode: str, args, cluster: Cluster, seed: int = 0) -> dict:
    global LENGTHS, DROPPED
    rng = np.random.default_rng(seed)
    # Enough for a generation pool that outruns its trainer by far (its stale samples dropped).
    total = args.batch * (args.steps + args.max_lag + 4) * 16
    lengths = draw_lengths(rng, total, args)
    noise = rng.lognormal(0.0, args.predict_sigma, total)
    LENGTHS = lengths
    groups = -(-total // args.group_size)
    DROPPED = np.repeat(rng.random(groups) < args.drop_groups, args.group_size)[:total]
    if mode in ("sync", "partial", "sync+multiplex", "partial+multiplex"):
        if args.split or mode.endswith("+multiplex"):   # async's split: each side idles in turn
            n_gen = max(1, round(cluster.accelerators * (args.gen_fraction or 0.5)))
            n_train = cluster.accelerators - n_gen
            return _sync(mode, args, cluster, n_gen, n_train,
                         lenders=n_train if mode.endswith("+multiplex") else 0)
        return _sync(mode, args, cluster, cluster.accelerators, cluster.accelerators)
    if args.gen_fraction:
        return _async(mode, args, cluster, lengths * noise,
                      max(1, round(cluster.accelerators * args.gen_fraction)))
    # Sized as a deployment would be: the split of generating and training accelerators that
    # gives the most samples/s, in steps of 1/16.
    splits = sorted({max(1, min(cluster.accelerators - 1, round(cluster.accelerators * k / 16)))
                     for k in range(1, 16)})
    return max((_async(mode, args, cluster, lengths * noise, n) for n in splits),
               key=lambda r: r["samples_per_s"])


def _sync(mode: str, args, c: Cluster, n_gen: int, n_train: int, lenders: int = 0) -> dict:
    """`n_gen` accelerators generate, then `n_train` train (all of them both, colocated, or
    two sets that idle in turn, --split). partial: generation stops at the batch's last sample
    instead of the longest admitted one; the rest keep their KV through the train phase (the
    engine pauses) and continue after it. A dropped group (--drop-groups) is replaced by a new
    one as it finishes; samples kept beyond the batch are trained in the next step.
    `lenders`: the trainer's accelerators generate too (the last instances) until the batch is
    complete; their unfinished samples then continue elsewhere, prefilled again with the
    tokens they reached."""
    gens = [Instance(i, c) for i in range(n_gen + lenders)]
    mode = mode.removesuffix("+multiplex")
    t, first, next_sample, gen_busy, train_busy = 0.0, 0.0, 0, 0.0, 0.0
    backlog: list[int] = []          # partial: admitted next step before new samples
    carried: dict[int, int] = {}     # sample -> tokens it had reached on a lender
    surplus: list[int] = []          # lengths of samples kept beyond the last batch
    for step in range(args.steps):
        for g in gens:
            g.time = max(g.time, t)
        trained, surplus = surplus[:args.batch], surplus[args.batch:]
        want = (args.batch - len(trained) if mode == "sync"
                else len(gens) * c.slots - sum(len(g.running) for g in gens))
        pending = backlog[::-1]
        backlog = []
        while len(pending) < want:
            pending.insert(0, next_sample)
            next_sample += 1
        # each to the instance with the fewest running, as a fleet's router places groups
        room = [(len(g.running), g.index) for g in gens if len(g.running) < c.slots]
        heapq.heapify(room)
        while room and pending:
            held, i = heapq.heappop(room)
            s = pending.pop()
            gens[i].admit(s, LENGTHS[s], carried.pop(s, 0))
            if held + 1 < c.slots:
                heapq.heappush(room, (held + 1, i))
        finishes = Finishes(gens)
        while len(trained) < args.batch:
            g, when = finishes.first()
            g.advance(when)
            for s in g.pop_finished():
                if DROPPED[s]:                            # regenerated
                    pending.insert(0, next_sample)
                    next_sample += 1
                else:
                    trained.append(LENGTHS[s])
                if mode == "partial" and not pending:     # the engines are kept full
                    pending.append(next_sample)
                    next_sample += 1
                if pending:
                    s = pending.pop()
                    g.admit(s, LENGTHS[s])
            finishes.update(g)
        if mode == "partial":      # everyone stops when the batch is complete
            gen_end = max(g.time for g in gens)
            for g in gens:
                g.advance(gen_end)
            moved = []
            for g in gens[n_gen:]:     # the lenders' samples continue elsewhere
                for finish, s in g.running:
                    carried[s] = g.step - (finish - LENGTHS[s])
                    moved.append(s)
                g.running, g.admit_sum = [], 0
            backlog = moved[::-1] + pending[::-1]
        else:                      # sync: every admitted sample finishes first
            for g in gens:
                while g.running:
                    g.advance(g.next_finish())
                    surplus += [LENGTHS[s] for s in g.pop_finished() if not DROPPED[s]]
            gen_end = max(g.time for g in gens)
        surplus = trained[args.batch:] + surplus
        trained = trained[:args.batch]
        train = c.train_s(trained, n_train)
        t = gen_end + train + c.reload_s
        first = first if step else t
        train_busy += train * n_train
    gen_busy = sum(g.busy_s for g in gens)
    return _result(mode + ("+multiplex" if lenders else ""), args, t, first, gen_busy,
                   train_busy, len(gens), n_train, 0)


def _async(mode: str, args, c: Cluster, predicted: np.ndarray, n_gen: int) -> dict:
    """`n_gen` accelerators generate without stopping; the rest train whenever a batch is
    ready. Events in time order: a sample finishing on an instance, the trainer finishing.
    --max-ahead bounds the samples finished and not trained (the training batch included)
    plus those generating, as jaxrl's actor does; a slot it holds back stays empty until
    the trainer takes a batch."""
    n_train = c.accelerators - n_gen
    gens = [Instance(i, c) for i in range(n_gen)]
    for g in gens:
        g.slow *= c.contention
    fresh = 0                          # samples finished within max_lag since the last step
    longest_first = mode == "async+length"
    waiting: list = []                 # heap of (priority, sample)
    started: dict[int, int] = {}       # sample -> weights version when it started
    done: list[int] = []               # finished, not yet trained
    next_sample, version, dropped = 0, 0, 0
    trainer_free, training, train_busy, first = math.inf, False, 0.0, 0.0

    def admit(g: Instance) -> None:
        nonlocal next_sample
        while len(waiting) < 2 * c.slots:
            heapq.heappush(waiting, (-predicted[next_sample] if longest_first else next_sample,
                                     next_sample))
            next_sample += 1
        s = heapq.heappop(waiting)[1]
        started[s] = version
        g.admit(s, LENGTHS[s])

    def room() -> bool:
        ahead = (len(done) + (args.batch if training else 0)
                 + sum(len(g.running) for g in gens))
        return not args.max_ahead or ahead < args.max_ahead

    def fill(now: float) -> None:
        for g in gens:
            if len(g.running) < c.slots and room():
                g.advance(now)
                while len(g.running) < c.slots and room():
                    admit(g)
                finishes.update(g)

    def train_if_ready(now: float) -> None:
        nonlocal trainer_free, training, train_busy, fresh
        if not training and len(done) >= args.batch:
            batch = done[:args.batch]
            del done[:args.batch]
            host, fresh = c.trainer_host_ms_per_sample * fresh / 1e3, 0
            seconds = c.train_s([LENGTHS[s] for s in batch], n_train) * c.contention + host
            trainer_free, training = now + seconds, True
            train_busy += seconds

    for g in gens:
        while len(g.running) < c.slots and room():
            admit(g)
    finishes = Finishes(gens)
    while version < args.steps:
        g, when = finishes.first()
        if training and trainer_free <= when:        # new weights, swapped in flight
            version, training = version + 1, False
            first = first if version > 1 else trainer_free
            if version == args.steps:                # the run ends with its last step
                break
            now = trainer_free
            for other in gens:
                other.time += c.swap_ms / 1e3
            finishes.rebuild()
            train_if_ready(now)
            fill(now)
            continue
        g.advance(when)
        for s in g.pop_finished():
            if version - started.pop(s) > args.max_lag:
                dropped += 1        # (a generator this far ahead would be held back instead)
            else:
                fresh += 1
                if not DROPPED[s]:
                    done.append(s)
        finishes.update(g)
        train_if_ready(when)
        fill(when)
    gen_busy = sum(g.busy_s for g in gens)
    return _result(mode, args, trainer_free, first, gen_busy, train_busy * n_train, n_gen,
                   n_train, dropped)


def _result(mode, args, seconds, first, gen_busy, train_busy, n_gen, n_train, dropped) -> dict:
    """`first`: when the first step ended. samples_per_s_after_first is the rate the RL benches
    report (bench/_rl_compare.py: from the end of the first step, which compiles)."""
    trained = args.steps * args.batch
    after = (trained - args.batch) / (seconds - first) if seconds > first else float("nan")
    return {"mode": mode, "seconds": seconds, "samples_per_s": trained / seconds,
            "samples_per_s_after_first": after,
            "generation_busy": gen_busy / (n_gen * seconds),
            "trainer_busy": train_busy / (n_train * seconds) if n_train else 0.0,
            "accelerators_generating": n_gen, "accelerators_training": n_train,
            "dropped_stale": dropped}


MODES = ("sync", "partial", "async", "async+length", "sync+multiplex", "partial+multiplex")
# What a calibration file may set: the measured costs and the workload they were measured on.
CALIBRATED = {"decode_ms", "decode_us_per_held", "decode_ms_by_rows", "prefill_us_per_token",
              "train_us_per_token", "train_ms_per_microbatch", "pack_len", "microbatch_rows",
              "max_segments", "drop_groups", "lengths", "group_size", "slots", "prompt_len",
              "batch", "max_lag", "swap_ms", "reload_s", "accelerators", "gen_fraction", "split",
              "trainer_host_ms_per_sample", "contention", "serve_overhead", "max_ahead"}


def _over_seeds(runs: list[dict]) -> dict:
    """One mode's runs over seeds: the means of its figures, each run's samples/s beside."""
    out = {k: (float(np.mean([r[k] for r in runs])) if isinstance(v, float) else v)
           for k, v in runs[0].items()}
    out["samples_per_s_by_seed"] = [r["samples_per_s"] for r in runs]
    return out


def _calibration_path(argv) -> str | None:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--calibration")
    return pre.parse_known_args(argv)[0].calibration


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--accelerators", type=int, default=128)
    p.add_argument("--params-b", type=float, default=7.0, help="model size, billions")
    p.add_argument("--kv-kib-per-token", type=float, default=56.0,
                   help="KV cache per token (Qwen2.5-7B: 28 layers x 4 KV heads x 128 x 2 x bf16)")
    p.add_argument("--hbm-gbps", type=float, default=3350.0, help="H100 SXM HBM3")
    p.add_argument("--hbm-efficiency", type=float, default=0.7)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="H100 dense bf16")
    p.add_argument("--mfu", type=float, default=0.4)
    p.add_argument("--slots", type=int, default=128, help="sequences per generation instance")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--median-len", type=float, default=1500.0)
    p.add_argument("--sigma", type=float, default=1.0, help="log-normal spread of lengths")
    p.add_argument("--max-len", type=int, default=16384)
    p.add_argument("--batch", type=int, default=8192, help="samples per optimizer step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--gen-fraction", type=float, default=0.0,
                   help="async: share of accelerators that generate (0: the best split)")
    p.add_argument("--max-lag", type=int, default=8)
    p.add_argument("--max-ahead", type=int, default=0,
                   help="async: samples finished and not trained plus generating, at most "
                        "(jaxrl's actor: a batch plus the slots, up to two batches; 0: no bound)")
    p.add_argument("--swap-ms", type=float, default=10.0, help="async: pause per update")
    p.add_argument("--reload-s", type=float, default=5.0,
                   help="sync: time to load new weights into the engines")
    p.add_argument("--predict-sigma", type=float, default=0.5,
                   help="async+length: log-normal noise of the length prediction")
    p.add_argument("--group-size", type=int, default=1,
                   help="samples per prompt sharing one output length")
    p.add_argument("--drop-groups", type=float, default=0.0,
                   help="share of groups dropped as they finish (jaxrl's "
                        "rl.filter_zero_advantage: every sample's reward equal), regenerated")
    p.add_argument("--split", action="store_true",
                   help="sync and partial on async's split of the accelerators, each side "
                        "idling in turn (rl.placement=split; two pinned CPU cores)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--seeds", type=int, default=1,
                   help="workloads drawn (lengths); figures are means over them")
    cal = p.add_argument_group("measured op costs (bench/calibrate.py); each replaces a "
                               "roofline formula")
    cal.add_argument("--calibration", metavar="JSON",
                     help="a file of measured costs and workload (written by bench/calibrate.py)"
                          ": its keys set these flags' defaults, flags given still win")
    cal.add_argument("--decode-ms", type=float, default=None, help="a decode step's fixed cost")
    cal.add_argument("--decode-us-per-held", type=float, default=0.0,
                     help="a decode step's cost per token held by its sequences")
    cal.add_argument("--decode-ms-by-rows", type=json.loads, default=None, metavar="JSON",
                     help='the fixed cost by rows decoded, e.g. {"8": 2.1, "128": 11.5}')
    cal.add_argument("--prefill-us-per-token", type=float, default=None)
    cal.add_argument("--train-us-per-token", type=float, default=None)
    cal.add_argument("--train-ms-per-microbatch", type=float, default=None,
                     help="a packed step's cost per microbatch, beyond its tokens' (with "
                          "--pack-len, --microbatch-rows, --max-segments)")
    cal.add_argument("--trainer-host-ms-per-sample", type=float, default=0.0,
                     help="trainer-side work per generated sample, on the trainer's cores")
    cal.add_argument("--contention", type=float, default=1.0,
                     help="async: each side's step costs this factor more beside the other's")
    cal.add_argument("--serve-overhead", type=float, default=1.0,
                     help="a served engine's decode and prefill over the measured costs")
    cal.add_argument("--pack-len", type=int, default=0)
    cal.add_argument("--microbatch-rows", type=int, default=0)
    cal.add_argument("--max-segments", type=int, default=0)
    cal.add_argument("--lengths", type=int, nargs="*", default=None,
                     help="output lengths to draw from instead of the log-normal")
    if (path := _calibration_path(argv)) is not None:
        p.set_defaults(**{k.replace("-", "_"): v for k, v in
                          json.loads(Path(path).read_text()).items()
                          if k.replace("-", "_") in CALIBRATED})
    args = p.parse_args(argv)
    if not 0 <= args.drop_groups < 1:
        p.error(f"--drop-groups={args.drop_groups} must be in [0, 1): a share of the groups")
    if args.train_ms_per_microbatch is not None and not (
            args.pack_len > 0 and args.microbatch_rows > 0 and args.max_segments > 0):
        p.error("--train-ms-per-microbatch needs --pack-len, --microbatch-rows and "
                "--max-segments (each > 0) to pack a step's samples")
    by_rows = ({int(r): float(ms) for r, ms in args.decode_ms_by_rows.items()}
               if args.decode_ms_by_rows else None)
    cluster = Cluster(args.accelerators, args.params_b, args.kv_kib_per_token, args.hbm_gbps,
                      args.hbm_efficiency, args.peak_tflops, args.mfu, args.slots,
                      args.prompt_len, args.swap_ms, args.reload_s, decode_ms=args.decode_ms,
                      decode_us_per_held=args.decode_us_per_held, decode_ms_by_rows=by_rows,
                      prefill_us_per_token=args.prefill_us_per_token,
                      train_us_per_token=args.train_us_per_token,
                      train_ms_per_microbatch=args.train_ms_per_microbatch,
                      pack_len=args.pack_len, microbatch_rows=args.microbatch_rows,
                      max_segments=args.max_segments,
                      trainer_host_ms_per_sample=args.trainer_host_ms_per_sample,
                      contention=args.contention, serve_overhead=args.serve_overhead)
    results = [_over_seeds([simulate(mode, args, cluster, seed) for seed in range(args.seeds)])
               for mode in args.modes]
    base = results[0]["samples_per_s"]
    after = results[0]["samples_per_s_after_first"]
    print(f"{'mode':<14} {'samples/s':>10} {'vs sync':>8} {'after 1st':>10} {'gen busy':>9} "
          f"{'train busy':>11} {'gen/train accel.':>17} {'dropped':>8}")
    for r in results:
        print(f"{r['mode']:<14} {r['samples_per_s']:>10.1f} {r['samples_per_s'] / base:>7.2f}x "
              f"{r['samples_per_s_after_first'] / after:>9.2f}x "
              f"{r['generation_busy']:>9.2f} {r['trainer_busy']:>11.2f} "
              f"{r['accelerators_generating']:>8}/{r['accelerators_training']:<8} "
              f"{r['dropped_stale']:>8}")
    print("reported by the papers (their clusters and workloads, not this model):")
    for name, figure in PAPERS.items():
        print(f"  {name}: {figure}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
