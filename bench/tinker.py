"""Tinker API: one SDK-driven RL loop against `jaxrl tinker` and against SkyRL tx, side by side.

The same loop (bench/tinker/loop.py: sample a group per prompt from the adapters just handed
over, reward, importance_sampling forward_backward, optim_step) runs against each service on
the same random Llama folder (bench/peers/job.py's model), each service and its client in its
own environment: jaxrl's with the tinker SDK 0.38, SkyRL tx 0.3.0's (built once from
bench/tinker/requirements-skyrl.txt) with the SDK 0.16.1 its API answers; the loop also runs
against `jaxrl tinker` from SkyRL's environment, so the two services meet one client. SkyRL tx starts its
engine with `uv run`; a shim runs that module with its environment's python instead. Printed
per service: seconds per loop step (median over steps 3..N), sampled and trained tokens per
second, the sampling share of a step, and seconds per step against jaxrl's.

    jaxrl bench tinker [--size 3m] [--steps 8] [--prompts 4] [--group 8] [--max-tokens 32]

`--learn`: the demo task instead (bench/tinker/learn.py): `make run`'s supervised warm-up
(`--checkpoint` a run's checkpoints, or trained here by `jaxrl train --config
configs/demo_cpu.yaml rl.steps=0`), exported as a Hugging Face folder, served by `jaxrl
tinker`, then an RL loop written against the SDK; held-out greedy accuracy before and after.

    jaxrl bench tinker --learn [--checkpoint runs/demo/checkpoints] [--learn-steps 400]
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
LEARN = HERE / "tinker" / "learn.py"
ROOT = HERE.parent
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


def start_jaxrl(folder: Path, work: Path, max_len: int, max_rank: int = 8):
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxrl.cli", "tinker", "--model", str(folder), "--port", "0",
         "--max-len", str(max_len), "--max-lora-rank", str(max_rank),
         "--state-dir", str(work / "state")],
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
    p.add_argument("--learn", action="store_true", help="the demo task's accuracy instead")
    p.add_argument("--checkpoint", default=None, help="with --learn: a warm-up's checkpoints")
    p.add_argument("--learn-steps", type=int, default=400)
    p.add_argument("--learn-lr", type=float, default=6e-4)
    args = p.parse_args(argv)
    if args.learn:
        return learn(args)
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
        python = None if args.no_skyrl else venv(Path(args.venvs))
        wait_until_quiet(0.25, "jaxrl tinker")
        proc, url = start_jaxrl(folder, work, max_len)
        try:
            results["jaxrl tinker"] = loop(Path(sys.executable), url, folder.name, args)
            if python is not None:    # the client SkyRL tx answers, against jaxrl too
                results["jaxrl, SDK 0.16"] = loop(python, url, folder.name, args)
        finally:
            stop(proc)
        if python is not None:
            wait_until_quiet(0.25, "SkyRL tx")
            proc, url = start_skyrl(python, folder, work)
            try:
                results["SkyRL tx"] = loop(python, url, str(folder), args)
            finally:
                stop(proc)
    report(args, results)


def demo_folder(work: Path, checkpoint: str | None) -> Path:
    """The demo's warm-up as a Hugging Face folder, with its character tokenizer as a
    tokenizer.json (what `jaxrl tinker` reads for EOS and stop strings)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    from jaxrl.models.tokenizer import CharTokenizer
    from jaxrl.rl.tasks.arithmetic import ArithmeticTask

    if checkpoint is None:
        subprocess.run([sys.executable, "-m", "jaxrl.cli", "train", "--config",
                        str(ROOT / "configs" / "demo_cpu.yaml"), "rl.steps=0",
                        f"run_dir={work / 'demo'}", "log.progress=false"], check=True)
        checkpoint = str(work / "demo" / "checkpoints")
    folder = work / "demo-hf"
    subprocess.run([sys.executable, "-m", "jaxrl.cli", "export", "--checkpoint", checkpoint,
                    "--out", str(folder)], check=True)
    chars = CharTokenizer(ArithmeticTask.alphabet)
    vocab = {s: i for i, s in enumerate(CharTokenizer.SPECIALS)}
    vocab |= {c: i + len(vocab) for i, c in enumerate(chars.alphabet)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}))
    return folder


def learn(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        folder = demo_folder(work, args.checkpoint)
        wait_until_quiet(0.25, "jaxrl tinker")
        proc, url = start_jaxrl(folder, work, 64, max_rank=32)
        try:
            out = subprocess.run([sys.executable, str(LEARN), "--url", url, "--model",
                                  folder.name, "--steps", str(args.learn_steps),
                                  "--lr", str(args.learn_lr)],
                                 capture_output=True, text=True)
        finally:
            stop(proc)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if out.returncode or line is None:
        sys.exit(f"tinker: the learning loop failed:\n{out.stderr[-3000:]}")
    r = json.loads(line[len("RESULT "):])
    rewards = [s["reward"] for s in r["steps"]]
    k = max(len(rewards) // 10, 1)
    print(f"\nThe demo task through the Tinker API: {args.learn_steps} SDK-driven RL steps "
          f"from the warm-up checkpoint ({r['loop_s']:.0f} s)")
    print(f"held-out greedy accuracy {r['before']:.3f} -> {r['after']:.3f} "
          f"({100 * (r['after'] - r['before']):+.1f} points); mean reward, first {k} steps "
          f"{sum(rewards[:k]) / k:.3f}, last {k} {sum(rewards[-k:]) / k:.3f}")


def report(args, results: dict) -> None:
    print(f"\nTinker API, one SDK-driven RL loop: {args.prompts} prompts x {args.group} "
          f"samples, up to {args.max_tokens} new tokens, LoRA rank 8, {args.size} Llama, "
          f"{args.steps} steps (median over steps 3..N)")
    print(f"{'service':<16}{'s/step':>9}{'sampled tok/s':>15}{'trained tok/s':>15}"
          f"{'sampling':>10}{'step 1 s':>10}{'vs jaxrl':>10}")
    base = results.get("jaxrl tinker")
    base_s = summarize(base)["s_per_step"] if isinstance(base, dict) else None
    for name, r in results.items():
        if not isinstance(r, dict):
            print(f"{name:<16} failed: {r}")
            continue
        s = summarize(r)
        ratio = f"{s['s_per_step'] / base_s:.2f}x" if base_s else "-"
        print(f"{name:<16}{s['s_per_step']:>9.2f}{s['sampled_per_s']:>15.0f}"
              f"{s['trained_per_s']:>15.0f}{s['sample_share']:>9.0%}{s['first_step_s']:>10.1f}"
              f"{ratio:>10}")


if __name__ == "__main__":
    main()
