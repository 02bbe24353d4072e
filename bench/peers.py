"""Peers: the same small GRPO job in jaxrl (sync, async), TRL and Tunix, side by side.

Each stack runs in a process of its own, one after the other, on the same random Llama folder
(bench/peers/job.py: the job, the model, the prompts and the reward). TRL's GRPOTrainer and
Tunix's GRPO learner each run in a virtual environment this benchmark builds from
bench/peers/requirements-{trl,tunix}.txt, so the project's own dependencies stay as they are. Printed per stack: s/step (median over steps 3..N), samples/s,
generated tokens/s, the generation and train shares of a step, CPU seconds per step, time to
the end of the first step, and samples/s against the best peer. Before each stack it checks
that nothing else is using the cores (shared cores distort every stack differently) and
refuses to report otherwise.

    jaxrl bench peers [--sizes 3m 30m] [--lengths 64 512] [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent / "peers"
sys.path.insert(0, str(HERE))
from _machine import wait_until_quiet  # noqa: E402
from job import Job, write_model  # noqa: E402

# What cannot be made equal across the stacks, printed with the results.
DIFFERENCES = [
    "loss: jaxrl truncated importance-sampling REINFORCE (rl.loss=tis) on leave-one-out "
    "advantages; TRL and Tunix their default GRPO loss (group-normalised advantages), "
    "Tunix with beta=0 and epsilon=0.2",
    "batch layout: jaxrl packs samples into rows of prompt + max_new_tokens; TRL pads each "
    "sample to the longest in the batch; Tunix pads prompts and completions to their limits",
    "microbatches: each stack accumulates gradients over microbatches of --microbatch "
    "samples (jaxrl's default, 16) into the one optimizer step; TRL over --trl-microbatch "
    "where given; Tunix counts its micro batch in prompts, so --microbatch / group size of "
    "them (the whole step where that is not whole)",
    "generation: jaxrl its paged engine (jit, XLA:CPU, its C++ paged attention); TRL Hugging "
    "Face `generate` (PyTorch eager); Tunix its vanilla sampler (jit, XLA:CPU, a dense KV "
    "cache)",
    "model: jaxrl and Tunix each load the folder's safetensors into their own Llama (Flax "
    "NNX); TRL runs transformers' LlamaForCausalLM",
    "jaxrl sync generates a step's samples with fixed weights and then trains, as TRL does; "
    "jaxrl async overlaps the two (PipelineRL)",
]


# name: (runner in bench/peers/, its extra arguments); a peer's name is also its venv's.
STACKS = {"jaxrl-sync": ("run_jaxrl.py", "sync"), "jaxrl-async": ("run_jaxrl.py", "async"),
          "trl": ("run_trl.py",), "tunix": ("run_tunix.py",)}


def venv(name: str, root: Path) -> Path:
    """The python of a virtual environment built from bench/peers/requirements-NAME.txt."""
    path = root / name
    python = path / "bin" / "python"
    stamp = path / ".requirements"
    wanted = (HERE / f"requirements-{name}.txt").read_text()
    if not python.exists() or not stamp.exists() or stamp.read_text() != wanted:
        print(f"peers: building the {name} environment in {path} (once)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "-r",
                        str(HERE / f"requirements-{name}.txt")], check=True)
        stamp.write_text(wanted)
    return python


def run(cmd: list[str], env: dict | None = None) -> dict | str:
    """A runner's RESULT, or why it failed (its last error line; the tail of its stderr is
    printed). A stack that fails (a peer out of memory at a shape) is reported as failed, and
    the others are still measured."""
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if out.returncode == 0 and line is not None:
        return json.loads(line[len("RESULT "):])
    print(f"peers: {' '.join(cmd[:3])} failed ({out.returncode}):\n{out.stderr[-3000:]}",
          file=sys.stderr, flush=True)
    return failure(out.stderr, out.returncode)


def failure(stderr: str, returncode: int) -> str:
    """A failed runner in one line: its last exception's line, else its exit status."""
    errors = [x.strip() for x in stderr.splitlines()
              if re.match(r"^[\w.]+(Error|Exception):", x.strip())]
    return errors[-1][:200] if errors else f"exit status {returncode}, no RESULT line"


def summarize(r: dict) -> dict:
    steps = r["steps"][2:] or r["steps"]          # steps 3..N: compilation and warm-up done
    wall = statistics.median(s["wall_s"] for s in steps)
    train = statistics.median(s["train_s"] for s in steps)
    return {"stack": r["stack"], "s_per_step": wall,
            "samples_per_s": statistics.median(s["samples"] / s["wall_s"] for s in steps),
            "tokens_per_s": statistics.median(s["generated_tokens"] / s["wall_s"]
                                              for s in steps),
            "train_share": train / wall, "cpu_s_per_step":
                statistics.median(s["cpu_s"] for s in steps),
            "first_step_s": r["first_step_s"],
            "second_step_s": r["steps"][1]["wall_s"] if len(r["steps"]) > 1 else None}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["3m"], choices=["3m", "30m"])
    p.add_argument("--lengths", nargs="+", type=int, default=[64])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--microbatch", type=int, default=Job.microbatch,
                   help="samples per forward and backward pass (every stack accumulates "
                        "its gradients into one optimizer step)")
    p.add_argument("--trl-microbatch", type=int, default=0,
                   help="TRL's samples per pass, if not --microbatch (128: the whole step)")
    p.add_argument("--rounds", type=int, default=2,
                   help="runs of each stack, in alternating order; figures are medians")
    p.add_argument("--stacks", nargs="+", default=list(STACKS), choices=list(STACKS))
    p.add_argument("--venvs", default=str(Path.home() / ".cache" / "jaxrl" / "peers"),
                   help="where the peers' virtual environments are built")
    p.add_argument("--busy-limit", type=float, default=0.15,
                   help="refuse to measure while other processes use more of the CPU")
    args = p.parse_args(argv)
    python = {name: venv(name, Path(args.venvs)) for name in ("trl", "tunix")
              if name in args.stacks}
    work = Path(tempfile.mkdtemp(prefix="jaxrl-peers-"))
    print("settings that differ between the stacks:\n  - " + "\n  - ".join(DIFFERENCES))
    for size in args.sizes:
        for length in args.lengths:
            job = Job(size=size, max_new_tokens=length, steps=args.steps,
                      microbatch=args.microbatch, trl_microbatch=args.trl_microbatch)
            model = work / f"model-{size}"
            if not model.exists():
                write_model(job, model)
            params = int((model / "job_params.txt").read_text())
            runs = {stack: [] for stack in args.stacks}
            failed: dict[str, str] = {}      # stack: why (not run again in later rounds)
            for round_ in range(args.rounds):   # every other round in reverse: drift evens out
                order = args.stacks if round_ % 2 == 0 else args.stacks[::-1]
                for stack in (s for s in order if s not in failed):
                    wait_until_quiet(args.busy_limit, "peers")
                    out = work / f"{stack}-{size}-{length}"
                    # The first round starts with empty compilation and kernel caches (a first
                    # run: jaxrl builds its C++ attention too), later rounds reuse them (a
                    # second run of the same config).
                    env = {"JAX_COMPILATION_CACHE_DIR": str(out / "xla-cache"),
                           "JAXRL_KERNEL_CACHE": str(out / "kernels")}
                    runner, *mode = STACKS[stack]
                    r = run([str(python.get(stack, sys.executable)), str(HERE / runner),
                             job.to_json(), str(model), str(out / f"round{round_}"), *mode], env)
                    if isinstance(r, str):
                        failed[stack] = r
                        print(f"  round {round_ + 1}, {stack}: failed ({r})", flush=True)
                        continue
                    runs[stack].append(summarize(r))
                    print(f"  round {round_ + 1}, {stack}: {runs[stack][-1]['s_per_step']:.2f} "
                          f"s/step", flush=True)
            report(job, params, [combine(r) for r in runs.values() if r], failed)


def combine(rounds: list[dict]) -> dict:
    """One row from a stack's rounds: the median of each figure; time to the end of the first
    step on a first run (round 1, empty cache) and on a second (the later rounds)."""
    out = {k: statistics.median(r[k] for r in rounds) for k in rounds[0] if k != "stack"}
    out.update(stack=rounds[0]["stack"], first_step_s=rounds[0]["first_step_s"],
               warm_first_step_s=statistics.median(r["first_step_s"] for r in rounds[1:])
               if len(rounds) > 1 else None)
    return out


def report(job: Job, params: int, results: list[dict], failed: dict[str, str]) -> None:
    peers = [r for r in results if not r["stack"].startswith("jaxrl")]
    best = max((r["samples_per_s"] for r in peers), default=None)
    print(f"\n{job.size} ({params / 1e6:.1f}M parameters), {job.prompts_per_step} prompts x "
          f"{job.group_size} samples, up to {job.max_new_tokens} new tokens, {job.steps} steps "
          f"(medians over steps 3..{job.steps} and over the rounds)")
    print(f"  {'stack':<12} {'s/step':>7} {'samples/s':>9} {'tokens/s':>9} {'train':>6} "
          f"{'gen':>6} {'CPU s':>6} {'1st step':>8} {'warm':>6} {'vs best peer':>12}")
    for r in results:
        ratio = f"{r['samples_per_s'] / best:.2f}x" if best else "-"
        warm = f"{r['warm_first_step_s']:5.1f}s" if r["warm_first_step_s"] else "     -"
        print(f"  {r['stack']:<12} {r['s_per_step']:7.2f} {r['samples_per_s']:9.1f} "
              f"{r['tokens_per_s']:9.0f} {r['train_share']:6.0%} {1 - r['train_share']:6.0%} "
              f"{r['cpu_s_per_step']:6.1f} {r['first_step_s']:7.1f}s {warm} {ratio:>12}")
    for stack, why in failed.items():
        print(f"  {stack:<12} failed: {why}")
    print("  (train: the optimizer step's share of a step; jaxrl async overlaps generation "
          "with it, so its gen column is what remains. 1st step: process start to the end of "
          "the first step with empty compilation and kernel caches; warm: the same with the "
          "caches the first round left)")


if __name__ == "__main__":
    main()
