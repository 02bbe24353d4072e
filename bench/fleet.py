"""Generation in other processes against in-process, and weight pushes over loopback.

1. The demo run (configs/demo_cpu.yaml, async) from one warm-up checkpoint with the same sample
   budget, one after the other: the trainer with its engine in-process, then the trainer and two
   `jaxrl serve` processes on this machine (rl.generation.servers), each server with half the
   slots, first streaming the weights over gRPC, then with the servers pulling them
   (rl.generation.transfer=jax, then tcp). Prints samples/s as a ratio, the weight pushes' bytes/s
   and each server's decode pause per update (its engine loop held to swap the weights in).
2. Weight pushes to a server that is decoding, over loopback, for models of growing size, by
   each path in turn: the gRPC stream (the default), the server pulling them over
   jax.experimental.transfer (rl.generation.transfer=jax) and over plain TCP (tcp). Bytes/s
   of the whole update (transfer, checks, assembly beside decoding) and the decode pause,
   which should not grow with the model.
3. Pushes to one server and to several (bench/_fanout.py): the seconds until all serve the
   version, by the gRPC stream and by tcp's relay chain.

    jaxrl bench fleet --rl-steps 60 [--warmup-dir runs/demo/checkpoints]
    (or: .venv/bin/python bench/fleet.py ...)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import _rl_compare as compare  # noqa: E402
import numpy as np  # noqa: E402
from _fanout import fanout  # noqa: E402
from flax import nnx  # noqa: E402

from jaxrl.config import load_run_config  # noqa: E402
from jaxrl.models import ModelConfig, Transformer, split_params  # noqa: E402
from serving.core.orchestrator import Orchestrator  # noqa: E402
from serving.fleet.client import RemoteGeneration  # noqa: E402
from serving.frontends.server import Server  # noqa: E402
from serving.runner.engine import Engine, EngineConfig  # noqa: E402
from serving.runner.sampling import SamplingParams  # noqa: E402

DEMO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo_cpu.yaml"
TOKEN = "bench-fleet"


def start_server(checkpoint: Path, token_file: Path, cfg) -> tuple[subprocess.Popen, str]:
    rl = cfg.rl
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxrl.cli", "serve", "--checkpoint", str(checkpoint),
         "--port", "0", "--slots", str(max(rl.engine.max_concurrent_decodes // 2, rl.group_size)),
         "--max-len", str(rl.sample_len + 1), "--max-prefill-length", str(rl.max_prompt_len),
         "--prefill-chunk", str(max(8, rl.max_prompt_len)), "--update-token-file",
         str(token_file), "--max-queued", str(4 * rl.batch_size)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    for line in proc.stdout:
        if "ready on" in line:
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, line.split("ready on ")[1].split(": ")[0]
    raise SystemExit("jaxrl serve did not start")


def fleet_vs_local(args, work: Path) -> dict:
    base = compare.warm_checkpoint(args, work)
    results = {"in-process": compare.run_variant(base, work, "in-process", args,
                                                  extra=("rl.mode=async",))}
    token_file = work / "token"
    token_file.write_text(TOKEN)
    cfg = load_run_config(args.config, args.overrides)
    servers = [start_server(base, token_file, cfg) for _ in range(2)]
    try:
        fleet = ("rl.mode=async", "rl.generation.servers=" + ",".join(a for _, a in servers),
                 f"rl.generation.token_file={token_file}")
        results["2 servers"] = compare.run_variant(base, work, "2 servers", args, extra=fleet)
        # The same servers again (the run's first push says `resume`), pulling the weights.
        results["2 servers, pulled"] = compare.run_variant(
            base, work, "2 servers, pulled", args, extra=(*fleet, "rl.generation.transfer=jax"))
        results["2 servers, tcp"] = compare.run_variant(
            base, work, "2 servers, tcp", args, extra=(*fleet, "rl.generation.transfer=tcp"))
        pauses = []
        for _, address in servers:
            remote = RemoteGeneration(address)
            m = remote.metrics()
            remote.close()
            pauses.append((m["updates"], m["update_pause_ms_mean"], m["update_pause_ms_max"]))
    finally:
        for proc, _ in servers:
            proc.terminate()
            proc.wait(60)
    compare.report({name: [r] for name, r in results.items()}, args.save)
    rows = results["2 servers"]["rows"]
    local_rows = results["in-process"]["rows"]
    pulled = results["2 servers, pulled"]["rows"]
    tcp = results["2 servers, tcp"]["rows"]
    out = {"samples_per_s_ratio": results["2 servers"]["samples_per_s"]
           / results["in-process"]["samples_per_s"],
           "pulled_samples_per_s_ratio": results["2 servers, pulled"]["samples_per_s"]
           / results["in-process"]["samples_per_s"],
           "tcp_samples_per_s_ratio": results["2 servers, tcp"]["samples_per_s"]
           / results["in-process"]["samples_per_s"],
           "tcp_bytes_per_s": tcp[-1]["push_bytes_per_s"],
           "push_bytes_per_s": rows[-1]["push_bytes_per_s"],
           "pull_bytes_per_s": pulled[-1]["push_bytes_per_s"],
           "pushes": rows[-1]["pushes"], "push_timeouts": rows[-1]["push_timeouts"],
           "server_pause_ms": [{"updates": u, "mean": mean, "max": mx} for u, mean, mx in pauses],
           "in_process_pause_ms_mean": float(np.mean([r["update_pause_ms"]
                                                      for r in local_rows]))}
    print(f"2 jaxrl serve processes vs in-process: samples/s {out['samples_per_s_ratio']:.2f}x "
          f"(weights pulled: {out['pulled_samples_per_s_ratio']:.2f}x, over tcp: "
          f"{out['tcp_samples_per_s_ratio']:.2f}x); "
          f"weight pushes {out['pushes']:.0f} at {out['push_bytes_per_s'] / 1e6:.1f} MB/s "
          f"(pulled: {out['pull_bytes_per_s'] / 1e6:.1f} MB/s, tcp: "
          f"{out['tcp_bytes_per_s'] / 1e6:.1f} MB/s) "
          f"({out['push_timeouts']:.0f} timed out); decode pause per update "
          + ", ".join(f"server {i}: mean {p['mean']:.2f} ms, max {p['max']:.2f} ms over "
                      f"{p['updates']} updates" for i, p in enumerate(out["server_pause_ms"]))
          + f"; in-process mean {out['in_process_pause_ms_mean']:.2f} ms")
    return out


def push_rate(embed: int, layers: int, pushes: int) -> dict:
    """Pushes `pushes` updates of a model of this size to an in-process server over loopback
    while it decodes greedy requests, by each path: streamed over gRPC, pulled by the server
    over jax.experimental.transfer (serving/weights/transfer.py) and over plain TCP
    (serving/weights/bulk.py). Bytes/s and the decode pause of each, the paths taking turns so that
    all see the same machine."""
    cfg = ModelConfig(vocab_size=1024, embed_dim=embed, num_layers=layers, num_heads=8,
                      num_kv_heads=4, head_dim=embed // 8, mlp_dim=4 * embed, max_seq_len=128)
    params = split_params(Transformer(cfg, rngs=nnx.Rngs(0)))[1]
    engine = Engine(cfg, EngineConfig(max_concurrent_decodes=4, max_len=128,
                                      max_prefill_length=16, prefill_chunk=16))
    server = Server(Orchestrator(engine, params, version=-1, eos_id=None).start(), port=0,
                    update_token=TOKEN).start()
    paths = {"grpc": RemoteGeneration(server.address, token=TOKEN),
             "jax": RemoteGeneration(server.address, token=TOKEN, transfer="jax"),
             "tcp": RemoteGeneration(server.address, token=TOKEN, transfer="tcp")}
    busy = threading.Event()

    def decode():                   # keep the server generating throughout
        while not busy.is_set():
            paths["grpc"].submit([1, 2, 3], SamplingParams(max_tokens=100,
                                                           temperature=0.0)).result()

    thread = threading.Thread(target=decode, daemon=True)
    thread.start()
    nbytes = sum(np.asarray(a).nbytes for a in _flat(params).values())
    version = 0
    for remote in paths.values():   # the first of each compiles the cast
        remote.update_params(params, version, timeout=600)
        version += 1
    seconds = {name: [] for name in paths}
    pauses = {name: [] for name in paths}
    for _ in range(pushes):
        for name, remote in paths.items():
            t0 = time.perf_counter()
            result = remote.update_params(params, version, timeout=600)
            seconds[name].append(time.perf_counter() - t0)
            pauses[name].append(1e3 * result.pause_s)
            version += 1
    busy.set()
    thread.join(60)
    for remote in paths.values():
        remote.close()
    server.stop(0)
    out = {"params_M": nbytes / 4 / 1e6, "bytes": nbytes}
    for name in paths:
        out[name] = {"bytes_per_s": nbytes / float(np.median(seconds[name])),
                     "pause_ms_median": float(np.median(pauses[name])),
                     "pause_ms_max": float(max(pauses[name]))}
    return out


def _flat(params, prefix=""):
    out = {}
    for k, v in params.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}/"))
        else:
            out[prefix + k] = v
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    compare.add_arguments(p, config=DEMO_CONFIG, rl_steps=60, target=0.35, window=10,
                          variants=[])
    p.add_argument("--push-sizes", default="256x4,512x8,1024x8",
                   help="models for the push measurement, EMBEDxLAYERS each")
    p.add_argument("--pushes", type=int, default=5, help="pushes per model size")
    p.add_argument("--skip-rl", action="store_true", help="only the push measurements")
    p.add_argument("--fanout", default="1,4",
                   help="servers pushed to at once, compared with the first (empty: skip)")
    p.add_argument("--fanout-size", default="1024x8", help="the fan-out's model, EMBEDxLAYERS")
    args = p.parse_args(argv)
    out = {}
    if not args.skip_rl:
        work = Path(tempfile.mkdtemp(prefix="jaxrl-bench-"))
        out["rl"] = fleet_vs_local(args, work)
        shutil.rmtree(work, ignore_errors=True)
    out["pushes"] = []
    for size in args.push_sizes.split(","):
        embed, layers = map(int, size.split("x"))
        r = push_rate(embed, layers, args.pushes)
        out["pushes"].append(r)
        g = r["grpc"]
        rates = ", ".join(f"{name} {p['bytes_per_s'] / 1e9:.3f} GB/s "
                          f"({p['bytes_per_s'] / g['bytes_per_s']:.1f}x, decode pause median "
                          f"{p['pause_ms_median']:.3f} ms, max {p['pause_ms_max']:.3f} ms)"
                          for name, p in r.items() if isinstance(p, dict))
        print(f"push of {r['params_M']:.1f}M float32 parameters ({r['bytes'] / 1e6:.0f} MB) to a "
              f"decoding server over loopback: {rates}", flush=True)
    if args.fanout:
        counts = [int(n) for n in args.fanout.split(",")]
        embed, layers = map(int, args.fanout_size.split("x"))
        r = out["fanout"] = fanout(embed, layers, counts, args.pushes)
        for transfer in ("grpc", "tcp"):
            t = r[transfer]
            print(f"push of {r['bytes'] / 1e6:.0f} MB to " + ", ".join(
                f"{n} server{'s' * (n > 1)} {t[n]:.2f} s ({t[n] / t[counts[0]]:.2f}x)"
                for n in counts) + f" over {transfer}", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
