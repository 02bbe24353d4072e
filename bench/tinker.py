"""Tinker API: one SDK-driven RL loop against `jaxrl tinker` and against SkyRL tx, side by side.

The same loop (bench/tinker/loop.py: sample a group per prompt from the adapters just handed
over, reward, importance_sampling forward_backward, optim_step) runs against each service on
the same random Llama folder (bench/peers/job.py's model), each service and its client in its
own environment: jaxrl's with the tinker SDK 0.38, SkyRL tx 0.3.0's (built once from
bench/tinker/requirements-skyrl.txt) with the SDK 0.16.1 its API answers. SkyRL tx starts its
engine with `uv run`; a shim runs that module with its environment's python instead. Printed
per service: seconds per loop step (median over steps 3..N), sampled and trained tokens per
second, the sampling share of a step, and seconds per step against jaxrl's.

    jaxrl bench tinker [--size 3m] [--steps 8] [--prompts 4] [--group 8] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "peers"))
sys.path.insert(0, str(HERE))
from _machine import wait_until_quiet  # noqa: E402
from job import Job, write_model  # noqa: E402
from peers import failure  # noqa: E402

LOOP = HERE / "tinker" / "loop.py"
UV_SHIM = """#!/bin/bash
shift                                              # run
while [ "$1" = "--extra" ]; do shift 2; done       # --extra tinker --extra jax
exec "$SKYRL_PYTHON" "$@"
"""


def venv(root: Path) -> Path:
    """SkyRL tx's environment, built once from bench/tinker/requirements-skyrl.txt."""
    path, wanted = root / "skyrl", (HERE / "tinker" / "requirements-skyrl.txt").read_text()
    python, stamp = path / "bin" / "python", path / ".requirements"
    if not python.exists() or not stamp.exists() or stamp.read_text() != wanted:
        print(f"tinker: building SkyRL tx's environment in {path} (once)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "-r",
                        str(HERE / "tinker" / "requirements-skyrl.txt")], check=True)
        stamp.write_text(wanted)
    return python


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_jaxrl(folder: Path, work: Path, max_len: int):
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxrl.cli", "tinker", "--model", str(folder), "--port", "0",
         "--max-len", str(max_len), "--max-lora-rank", "8", "--state-dir", str(work / "state")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if "ready on " in line:
            return proc, line.split("ready on ")[1].split(" ")[0]
    raise RuntimeError("jaxrl tinker did not start")


def start_skyrl(python: Path, folder: Path, work: Path):
    shim = work / "bin"
    shim.mkdir(exist_ok=True)
    (shim / "uv").write_text(UV_SHIM)
    (shim / "uv").chmod(0o755)
    port = free_port()
    env = {**os.environ, "PATH": f"{shim}:{os.environ['PATH']}", "SKYRL_PYTHON": str(python),
           "JAX_PLATFORMS": "cpu"}
    log = open(work / "skyrl.log", "w")
    proc = subprocess.Popen(
        [str(python), "-m", "tx.tinker.api", "--base-model", str(folder), "--host", "127.0.0.1",
         "--port", str(port), "--database-url", f"sqlite:///{work / 'tx.db'}",
         "--checkpoints-base", str(work / "tx_checkpoints"),
         "--backend-config", json.dumps({"max_lora_rank": 8})],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=1)
            return proc, url
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.5)
    raise RuntimeError(f"SkyRL tx did not start:\n{(work / 'skyrl.log').read_text()[-3000:]}")


def stop(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def loop(python: Path, url: str, model: str, args) -> dict | str:
    cmd = [str(python), str(LOOP), "--url", url, "--model", model, "--steps", str(args.steps),
           "--prompts", str(args.prompts), "--group", str(args.group),
           "--max-tokens", str(args.max_tokens)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if out.returncode == 0 and line is not None:
        return json.loads(line[len("RESULT "):])
    print(f"tinker: the loop against {url} failed:\n{out.stderr[-3000:]}", file=sys.stderr)
    return failure(out.stderr, out.returncode)


def summarize(r: dict) -> dict:
    steps = r["steps"][2:] or r["steps"]
    wall = statistics.median(s["wall_s"] for s in steps)
    return {"s_per_step": wall,
            "sampled_per_s": statistics.median(s["sampled_tokens"] / s["wall_s"] for s in steps),
            "trained_per_s": statistics.median(s["trained_tokens"] / s["wall_s"] for s in steps),
            "sample_share": statistics.median(s["sample_s"] / s["wall_s"] for s in steps),
            "first_step_s": r["steps"][0]["wall_s"], "create_s": r["create_s"]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="3m", choices=("3m", "30m"))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--venvs", default=str(Path.home() / ".cache" / "jaxrl" / "peers"))
    p.add_argument("--no-skyrl", action="store_true", help="measure jaxrl tinker alone")
    args = p.parse_args(argv)
    results: dict[str, dict | str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        folder = work / "model"
        write_model(Job(size=args.size), folder)
        config = json.loads((folder / "config.json").read_text())   # SkyRL tx reads rope_theta
        config.setdefault("rope_theta", config.get("rope_parameters", {}).get("rope_theta",
                                                                              10000.0))
        (folder / "config.json").write_text(json.dumps(config, indent=1))
        max_len = 1 + 16 + args.max_tokens + 16
        wait_until_quiet(0.25, "jaxrl tinker")
        proc, url = start_jaxrl(folder, work, max_len)
        try:
            results["jaxrl tinker"] = loop(Path(sys.executable), url, folder.name, args)
        finally:
            stop(proc)
        if not args.no_skyrl:
            python = venv(Path(args.venvs))
            wait_until_quiet(0.25, "SkyRL tx")
            proc, url = start_skyrl(python, folder, work)
            try:
                results["SkyRL tx"] = loop(python, url, str(folder), args)
            finally:
                stop(proc)
    report(args, results)


def report(args, results: dict) -> None:
    print(f"\nTinker API, one SDK-driven RL loop: {args.prompts} prompts x {args.group} "
          f"samples, up to {args.max_tokens} new tokens, LoRA rank 8, {args.size} Llama, "
          f"{args.steps} steps (median over steps 3..N)")
    print(f"{'service':<14}{'s/step':>9}{'sampled tok/s':>15}{'trained tok/s':>15}"
          f"{'sampling':>10}{'step 1 s':>10}{'vs jaxrl':>10}")
    base = results.get("jaxrl tinker")
    base_s = summarize(base)["s_per_step"] if isinstance(base, dict) else None
    for name, r in results.items():
        if not isinstance(r, dict):
            print(f"{name:<14} failed: {r}")
            continue
        s = summarize(r)
        ratio = f"{s['s_per_step'] / base_s:.2f}x" if base_s else "-"
        print(f"{name:<14}{s['s_per_step']:>9.2f}{s['sampled_per_s']:>15.0f}"
              f"{s['trained_per_s']:>15.0f}{s['sample_share']:>9.0%}{s['first_step_s']:>10.1f}"
              f"{ratio:>10}")


if __name__ == "__main__":
    main()
