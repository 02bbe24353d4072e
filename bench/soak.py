"""Soak: `jaxrl serve` under minutes of mixed traffic, for compilations after ready and memory.

A `jaxrl serve` process (the demo model, or --model FOLDER) takes, for --minutes: gRPC and
OpenAI HTTP streams at once from --clients threads, with random prompt and output lengths that
cross every prefill bucket and page-table width, sampled groups (n up to 4), a fifth of the
streams cancelled part-way, and a weight update pushed every second. It prints requests served,
errors, the XLA compilations the server made after it said ready (none is the contract), and
its resident memory after the first minute and at the end. The last line is JSON with
`requests`, `errors`, `compiles_after_ready`, `rss_growth` (the fraction by which resident
memory grew from the end of minute 1 to the end) and the rest.

    jaxrl bench soak --minutes 10      (or: .venv/bin/python bench/soak.py ...)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import grpc  # noqa: E402
import httpx  # noqa: E402

from serving.fleet.client import open_channel, push_weights  # noqa: E402
from serving.proto import generation_pb2 as gen  # noqa: E402
from serving.proto import generation_pb2_grpc as gen_grpc  # noqa: E402

TOKEN = "bench-soak"


def start(args, token_file: Path) -> tuple[subprocess.Popen, str, int]:
    cmd = [sys.executable, "-m", "jaxrl.cli", "serve", "--port", "0", "--http-port", "0",
           "--slots", str(args.slots), "--max-len", str(args.max_len),
           "--max-prefill-length", str(args.max_prompt), "--prefill-chunk", "16",
           "--update-token-file", str(token_file), "--max-queued", "4096"]
    cmd += ["--model", args.model] if args.model else ["--checkpoint", "/nonexistent"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    http_port = None
    for line in proc.stdout:
        print("  server:", line.rstrip(), flush=True)
        if "OpenAI-compatible API on" in line:
            http_port = int(line.split("http://")[1].split("/")[0].rsplit(":", 1)[1])
        if "ready on" in line:
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, line.split("ready on ")[1].split(": ")[0], http_port
    raise SystemExit("jaxrl serve did not start")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


class Traffic:
    def __init__(self, args, address: str, http_port: int, vocab: int):
        self.args, self.address, self.vocab = args, address, vocab
        self.url = f"http://127.0.0.1:{http_port}/v1"
        self.requests = self.errors = self.cancelled = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.error_samples: list[str] = []

    def _count(self, ok: bool, cancelled: bool = False, why: str = "") -> None:
        with self.lock:
            self.requests += 1
            self.errors += not ok
            self.cancelled += cancelled
            if why and len(self.error_samples) < 5:
                self.error_samples.append(why)

    def _shape(self, rng: random.Random):
        prompt = rng.randint(1, self.args.max_prompt)
        return prompt, rng.randint(1, self.args.max_len - prompt - 1), rng.randint(1, 4)

    def grpc_client(self, seed: int) -> None:
        rng = random.Random(seed)
        stub = gen_grpc.GenerationStub(open_channel(self.address))
        while not self.stop.is_set():
            length, max_tokens, n = self._shape(rng)
            cancel = rng.random() < 0.2
            request = gen.GenerateRequest(
                token_ids=gen.TokenIds(ids=[rng.randrange(3, self.vocab) for _ in range(length)]),
                sampling=gen.SamplingOptions(max_tokens=max_tokens, n=n, temperature=1.0,
                                             seed=rng.randrange(2**31), ignore_eos=True))
            call = stub.Generate(request, timeout=300)
            try:
                for i, _ in enumerate(call):
                    if cancel and i >= 2:
                        call.cancel()
                        break
                self._count(True, cancel)
            except grpc.RpcError as e:
                ok = cancel and e.code() == grpc.StatusCode.CANCELLED
                self._count(ok, cancel, "" if ok else f"gRPC {e.code()}: {e.details()}")

    def http_client(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=300) as client:
            while not self.stop.is_set():
                length, max_tokens, n = self._shape(rng)
                cancel = rng.random() < 0.2
                body = {"prompt": [rng.randrange(3, self.vocab)
                                                   for _ in range(length)],
                        "max_tokens": max_tokens, "n": n, "stream": True, "temperature": 1.0}
                try:
                    with client.stream("POST", f"{self.url}/completions", json=body) as r:
                        if r.status_code != 200:
                            r.read()
                            self._count(False, why=f"HTTP {r.status_code}: {r.text[:200]}")
                            continue
                        for i, line in enumerate(r.iter_lines()):
                            if '"error"' in line:
                                raise RuntimeError(line[:200])
                            if cancel and i >= 4:
                                break
                    self._count(True, cancel)
                except Exception as e:  # noqa: BLE001 (every failure is counted and shown)
                    self._count(False, cancel, f"HTTP: {e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--model", default=None, help="a Hugging Face folder (default: the demo "
                   "model, freshly initialised)")
    p.add_argument("--clients", type=int, default=8, help="client threads, half gRPC, half HTTP")
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=32)
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="jaxrl-soak-"))
    token_file = work / "token"
    token_file.write_text(TOKEN)
    proc, address, http_port = start(args, token_file)
    try:
        channel = open_channel(address)
        metrics = lambda: json.loads(gen_grpc.GenerationStub(channel).GetMetrics(  # noqa: E731
            gen.MetricsRequest()).json)
        ready = metrics()
        weights = _served_weights(args)
        traffic = Traffic(args, address, http_port, ready["vocab_size"])
        clients = [threading.Thread(target=traffic.grpc_client if i % 2 else traffic.http_client,
                                    args=(i,), daemon=True) for i in range(args.clients)]
        for c in clients:
            c.start()
        start_t, version, rss_1 = time.monotonic(), 0, None
        end = start_t + 60 * args.minutes
        while time.monotonic() < end and proc.poll() is None:
            time.sleep(1.0)
            version += 1
            push_weights(channel, weights, version, TOKEN, timeout=60)
            if rss_1 is None and time.monotonic() - start_t >= 60:
                rss_1 = rss_bytes(proc.pid)
                print(f"after minute 1: {traffic.requests} requests, resident "
                      f"{rss_1 / 2**20:.0f} MiB", flush=True)
        traffic.stop.set()
        for c in clients:
            c.join(330)
        final = metrics()
        rss_end = rss_bytes(proc.pid)
    finally:
        proc.terminate()
        proc.wait(60)
    rss_1 = rss_1 or rss_end
    out = {"minutes": args.minutes, "requests": traffic.requests, "errors": traffic.errors,
           "cancelled": traffic.cancelled, "updates": version,
           "compiles_after_ready": final["process_compiles"] - ready["process_compiles"],
           "late_engine_compiles": final["late_compiles"], "rss_minute_1": rss_1,
           "rss_end": rss_end, "rss_growth": rss_end / rss_1 - 1,
           "generated_tokens": final["generated_tokens"],
           "update_pause_ms_max": final["update_pause_ms_max"]}
    print(f"{out['requests']} requests ({out['cancelled']} cancelled), {out['errors']} errors, "
          f"{version} weight updates; compilations after ready: {out['compiles_after_ready']}; "
          f"resident memory {rss_1 / 2**20:.0f} MiB after minute 1, {rss_end / 2**20:.0f} MiB "
          f"at the end ({100 * out['rss_growth']:+.1f}%)")
    for why in traffic.error_samples:
        print("  error:", why)
    print(json.dumps(out))


def _served_weights(args):
    """Weights shaped like the served model's (random: the soak checks the runtime, not text)."""
    import jax
    import numpy as np

    from jaxrl.config import RunConfig
    from jaxrl.models import abstract_model, load_hf_config, split_params

    cfg = load_hf_config(args.model) if args.model else RunConfig().model
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda a: (0.02 * rng.standard_normal(a.shape)).astype(np.float32),
                        split_params(abstract_model(cfg))[1])


if __name__ == "__main__":
    main()
