"""Generation servers a run starts on its own machine (`rl.generation.launch`): `jaxrl serve`
processes on 127.0.0.1, each pinned to CPU cores of its own, with the trainer pinned to the
others. On a CPU host this is what two accelerators give a disaggregated run: the trainer and
the engine never compete for a core, so a sync run's generator idles while the trainer steps
(and the other way round), exactly as on separate devices, and async's overlap can show.

XLA:CPU sizes its thread pools to the cores a process may run on when its backend starts, so
the trainer is pinned before JAX starts (`pin_trainer`, called by `jaxrl train` first thing);
each server pins itself the same way (`jaxrl serve --cpus`). The servers start from the run's
newest checkpoint and take the trainer's weights before they take work (jaxrl/rollout/
fleet.py), then stream rollouts back over gRPC like any remote server. They are stopped with
the run.

Imports nothing heavy: `jaxrl train` calls `pin_trainer` before JAX is imported."""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from jaxrl.errors import UserError


def parse_cpus(spec: str, name: str = "rl.generation.cpus") -> list[int]:
    """"1", "2-3", "0,2-3" as a sorted list of core numbers; UserError naming the bad part (and
    the option, `name`, that gave it)."""
    cores: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise UserError(f"{name}={spec!r}: {part!r} is not a core or a range of cores "
                            f"like '2-3'")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return sorted(cores)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which cores the trainer and each launched server run on (empty: not pinned)."""
    trainer: list[int]
    servers: list[list[int]]


def plan(launch: int, cpus: str, available: list[int] | None = None) -> Plan:
    """The cores of `cpus` split evenly among `launch` servers, the trainer on the rest of
    `available` (this process's cores). No `cpus`: nothing is pinned."""
    if not cpus:
        return Plan([], [[] for _ in range(launch)])
    available = _cores_before_pinning() if available is None else available
    cores = parse_cpus(cpus)
    missing = [c for c in cores if c not in available]
    if missing:
        raise UserError(f"rl.generation.cpus={cpus!r}: core(s) {missing} are not among this "
                        f"process's cores {available}")
    trainer = [c for c in available if c not in cores]
    if not trainer:
        raise UserError(f"rl.generation.cpus={cpus!r} takes every core ({available}); leave "
                        f"at least one to the trainer")
    if len(cores) < launch:
        raise UserError(f"rl.generation.cpus={cpus!r} has {len(cores)} core(s) for "
                        f"rl.generation.launch={launch} servers: at least one each")
    share = len(cores) // launch
    return Plan(trainer, [cores[i * share:(i + 1) * share] for i in range(launch)])


_BEFORE_PINNING: list[int] = []


def _cores_before_pinning() -> list[int]:
    """This process's cores as it started (before pin_trainer narrowed them)."""
    return _BEFORE_PINNING or sorted(os.sched_getaffinity(0))


def pin_trainer(cfg) -> list[int]:
    """Pins this process to the trainer's cores of `cfg`'s plan, if it has one; returns them.
    Call it before JAX starts its backend: XLA:CPU's thread pools size to the cores allowed."""
    g = cfg.rl.generation
    cores = plan(g.launch, g.cpus).trainer if g.launch and cfg.rl.steps else []
    if cores:
        pin(cores)
    return cores


def pin(cores: list[int], name: str = "rl.generation.cpus") -> None:
    """This process, every thread of it, on `cores` from now on (any cores of the machine, not
    only those it was started on: a launched server leaves its pinned parent's); UserError
    naming the option (`name`) that asked for cores it cannot have."""
    before = _cores_before_pinning()
    try:
        os.sched_setaffinity(0, cores)
    except (OSError, ValueError) as e:
        raise UserError(f"{name}: cannot run on cores {cores} ({e}); this machine has "
                        f"{os.cpu_count()} cores") from None
    _BEFORE_PINNING[:] = before
    for tid in os.listdir("/proc/self/task"):       # every thread, not just this one
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:                   # a thread that just ended
            pass


# rl.engine's settings that `jaxrl serve` takes no flag for: a launched server runs them at
# EngineConfig's defaults, so a run that sets them launches no server.
NOT_LAUNCHED = ("steps_per_dispatch", "page_buckets", "min_table_tokens")


def unlaunchable(engine) -> list[str]:
    """The settings of `engine` (rl.engine) a launched `jaxrl serve` could not hold."""
    default = type(engine)()
    return [f"rl.engine.{name}={getattr(engine, name)}" for name in NOT_LAUNCHED
            if getattr(engine, name) != getattr(default, name)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServers:
    """`launch` `jaxrl serve` processes serving `checkpoint_dir` with `engine`'s sizes, each
    pinned to its cores of `cores`, holding the model the run's engines hold (`served`, a
    ModelConfig: its dtype, its projections quantized as rl.generation.weights asks, LoRA
    adapters shaped as the run trains them). Their addresses and update token are known at
    once; they answer once they have compiled (the fleet connects them as they do)."""

    def __init__(self, checkpoint_dir: Path, engine, served, cores: list[list[int]],
                 run_dir: Path, log=print, admission: str = "fifo"):
        self.token = secrets.token_hex(16)
        self.token_file = Path(run_dir) / "launched_servers.token"
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.token)
        self.addresses, self.procs, self.logs = [], [], []
        try:
            for i, pinned in enumerate(cores):
                port = free_port()
                log_path = Path(run_dir) / f"launched_server_{i}.log"
                cmd = [sys.executable, "-m", "jaxrl.cli", "serve", "--checkpoint",
                       str(checkpoint_dir), "--host", "127.0.0.1", "--port", str(port),
                       "--slots", str(engine.max_concurrent_decodes),
                       "--max-len", str(engine.max_len),
                       "--max-prefill-length", str(engine.max_prefill_length),
                       "--prefill-chunk", str(engine.prefill_chunk),
                       "--page-size", str(engine.page_size), "--dtype", served.dtype,
                       "--kv-cache-dtype", engine.kv_cache_dtype,
                       "--attention", engine.attention,
                       "--num-pages", str(engine.num_pages),
                       "--memory-fraction", str(engine.memory_fraction),
                       "--speculative", engine.speculative,
                       "--speculative-tokens", str(engine.speculative_tokens),
                       "--admission", admission,
                       "--update-token-file", str(self.token_file)]
                cmd += ["--record-routes"] if engine.record_routes else []
                cmd += ["--score"] if engine.score else []
                if served.quantize != "none":
                    cmd += ["--quantize", served.quantize]
                adapters = served.lora
                if adapters.enabled:
                    cmd += ["--lora-rank", str(adapters.rank), "--lora-alpha",
                            str(adapters.alpha), "--lora-targets", ",".join(adapters.targets)]
                    cmd += ["--lora-rslora"] if adapters.use_rslora else []
                if pinned:
                    cmd += ["--cpus", ",".join(map(str, pinned))]
                out = open(log_path, "w")    # noqa: SIM115 (closed in close)
                self.logs.append(out)
                self.procs.append(subprocess.Popen(
                    cmd, stdout=out, stderr=subprocess.STDOUT,
                    env={**os.environ, "JAX_PLATFORMS": "cpu"}))
                self.addresses.append(f"127.0.0.1:{port}")
                where = f"cores {pinned}" if pinned else "unpinned"
                log(f"launched jaxrl serve on {self.addresses[-1]} ({where}; log {log_path})")
        except BaseException:
            self.close()
            raise

    def wait_ready(self, timeout_s: float) -> None:
        """Returns once every server says it is ready; UserError with the end of its log if one
        exits first (or is not ready within `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        waiting = set(range(len(self.procs)))
        while waiting:
            for i in sorted(waiting):
                path = Path(self.logs[i].name)
                if "jaxrl serve: ready on" in path.read_text(errors="replace"):
                    waiting.discard(i)
                elif self.procs[i].poll() is not None or time.monotonic() > deadline:
                    what = (f"exited with status {self.procs[i].returncode}"
                            if self.procs[i].returncode is not None else
                            f"was not ready after {timeout_s:.0f} s")
                    tail = path.read_text(errors="replace")[-2000:]
                    raise UserError(f"launched jaxrl serve on {self.addresses[i]} {what}; the "
                                    f"end of its log ({path}):\n{tail}")
            time.sleep(0.2)

    def config(self, cfg):
        """`cfg` with these servers as its generation servers."""
        g = dataclasses.replace(cfg.rl.generation, servers=tuple(self.addresses),
                                token_file=str(self.token_file))
        return dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, generation=g))

    def exit_codes(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def close(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (jaxrl serve drains and exits), then SIGKILL after `timeout_s`."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for f in self.logs:
            f.close()
