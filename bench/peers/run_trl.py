"""bench/peers.py's job in TRL's GRPOTrainer (its own venv: PyTorch CPU, HF `generate`).
argv: job JSON, model folder, work folder."""

import time

START = time.time()

import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from job import Job, prompts, result, reward  # noqa: E402

import datasets  # noqa: E402
import transformers  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

GENERATE_S = [0.0]      # time inside HF generate, over the run
_generate = transformers.GenerationMixin.generate


def timed_generate(self, *args, **kwargs):
    t0 = time.perf_counter()
    try:
        return _generate(self, *args, **kwargs)
    finally:
        GENERATE_S[0] += time.perf_counter() - t0


transformers.GenerationMixin.generate = timed_generate


class Steps(transformers.TrainerCallback):
    def __init__(self, job: Job):
        self.job, self.rows, self.before = job, [], (START, 0.0, 0.0)

    def on_step_end(self, args, state, control, **kwargs):
        now, cpu, gen = time.time(), time.process_time(), GENERATE_S[0]
        self.rows.append({"wall_s": now - self.before[0], "cpu_s": cpu - self.before[1],
                          "generate_s": gen - self.before[2],
                          "samples": self.job.samples_per_step})
        self.before = (now, cpu, gen)


def main(job_json: str, model: str, work: str) -> None:
    job = Job.from_json(job_json)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    data = datasets.Dataset.from_dict({"prompt": prompts(job)})
    completion_tokens = []

    def reward_fn(completions, completion_ids=None, **kwargs):
        completion_tokens.append(sum(len(c) for c in completion_ids or []))
        return [reward(c) for c in completions]

    config = GRPOConfig(
        output_dir=work, use_cpu=True, bf16=False, fp16=False, report_to="none",
        # One generation of the whole step's samples, then its microbatches accumulated into
        # one optimizer step (steps_per_generation follows the accumulation).
        max_steps=job.steps, per_device_train_batch_size=job.trl_batch,
        gradient_accumulation_steps=job.samples_per_step // job.trl_batch,
        num_generations=job.group_size,
        max_completion_length=job.max_new_tokens, temperature=1.0, beta=0.0,
        learning_rate=job.lr, lr_scheduler_type="constant", warmup_steps=0,
        num_iterations=1, logging_steps=1, save_strategy="no", seed=job.seed,
        dataloader_num_workers=0, disable_tqdm=True)
    steps = Steps(job)
    trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=config, train_dataset=data,
                          processing_class=tokenizer, callbacks=[steps])
    trainer.train()
    for row, tokens in zip(steps.rows, completion_tokens):
        row["generated_tokens"] = tokens
        row["train_s"] = row["wall_s"] - row["generate_s"]
    print("RESULT " + json.dumps(result(job, "TRL", steps.rows, steps.rows[0]["wall_s"])))


if __name__ == "__main__":
    main(*sys.argv[1:])
