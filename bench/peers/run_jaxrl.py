"""bench/peers.py's job in jaxrl (its own venv: the repository's .venv), through the Python API
with the job's reward as a custom task. argv: job JSON, model folder, work folder, mode."""

import time

START = time.time()

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).parent))
from job import Job, prompts, result, reward  # noqa: E402

from jaxrl.api import CustomTask, train  # noqa: E402


def main(job_json: str, model: str, work: str, mode: str, *overrides: str) -> None:
    job = Job.from_json(job_json)
    rows = [{"prompt": p} for p in prompts(job)]
    task = CustomTask.from_rows(rows, lambda prompt, completion: reward(completion),
                                held_out=1)
    sample_len = job.prompt_words + 1 + job.max_new_tokens
    train(None, [
        f"hf_path={model}", f"run_dir={work}", "model.dtype=float32", "log.progress=false",
        "train.steps=0", "train.eval_problems=0", f"rl.steps={job.steps}", f"rl.mode={mode}",
        f"rl.prompts_per_step={job.prompts_per_step}", f"rl.group_size={job.group_size}",
        f"rl.max_prompt_len={job.prompt_words + 1}", f"rl.max_new_tokens={job.max_new_tokens}",
        "rl.temperature=1.0", f"rl.engine.max_concurrent_decodes={job.samples_per_step}",
        f"rl.pack_len={sample_len}",
        f"rl.microbatch_rows={job.microbatch}", "rl.kl_coef=0.0",
        # Every sample is trained on, as the peers do (their GRPO keeps truncated samples).
        "rl.filter_overlong=false", "rl.filter_zero_advantage=false",
        f"rl.optim.lr={job.lr}", "rl.optim.warmup_steps=0", "rl.optim.min_lr_ratio=1.0",
        "checkpoint.every=100000", *overrides], task=task, log=lambda _: None)
    metrics = [json.loads(line) for line in open(Path(work) / "metrics.jsonl")]
    metrics = [m for m in metrics if "step_s" in m]
    steps, before = [], (START, 0.0)
    for m in metrics:
        wall = m["unix_time"] - before[0]
        steps.append({"wall_s": wall, "train_s": m["step_s"], "wait_s": m["trainer_wait_s"],
                      "cpu_s": m["process_cpu_s"] - before[1], "samples": job.samples_per_step,
                      "generated_tokens": m["generated_tokens_per_s"] * wall})
        before = (m["unix_time"], m["process_cpu_s"])
    print("RESULT " + json.dumps(result(job, f"jaxrl {mode}", steps,
                                        metrics[0]["unix_time"] - START)))


if __name__ == "__main__":
    main(*sys.argv[1:])
