"""bench/peers.py's job in Tunix's GRPO learner (its own venv: google-tunix on the same JAX and
XLA:CPU as jaxrl, its own Llama3 model loaded from the folder's safetensors, its vanilla
rollout). argv: job JSON, model folder, work folder."""

import time

START = time.time()

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).parent))
from job import SIZES, Job, prompts, result, reward  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import transformers  # noqa: E402
from tunix.models.llama3 import model as llama  # noqa: E402
from tunix.models.llama3 import params as llama_params  # noqa: E402
from tunix.rl import rl_cluster as rl_cluster_lib  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402


class Clock:
    """Time spent in the cluster's generate and in its actor update, per step."""

    def __init__(self):
        self.generate_s = self.train_s = 0.0
        self.rows, self.before = [], (START, 0.0, 0.0, 0.0)

    def wrap(self, obj, name: str, field: str, calls_per_step: int = 0):
        """Times `obj.name` into `field`; every `calls_per_step`-th call ends a step (Tunix
        updates the actor once per micro batch, so a step is that many calls)."""
        inner = getattr(obj, name)
        calls = 0

        def timed(*args, **kwargs):
            nonlocal calls
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                setattr(self, field, getattr(self, field) + time.perf_counter() - t0)
                calls += 1
                if calls_per_step and calls % calls_per_step == 0:
                    self.step_done()

        setattr(obj, name, timed)

    def step_done(self):
        now, cpu = time.time(), time.process_time()
        b = self.before
        self.rows.append({"wall_s": now - b[0], "cpu_s": cpu - b[1],
                          "generate_s": self.generate_s - b[2], "train_s": self.train_s - b[3]})
        self.before = (now, cpu, self.generate_s, self.train_s)


def main(job_json: str, model_dir: str, work: str) -> None:
    job = Job.from_json(job_json)
    s = SIZES[job.size]
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    config = llama.ModelConfig(
        num_layers=s.layers, vocab_size=len(tokenizer), embed_dim=s.hidden, hidden_dim=s.mlp,
        num_heads=s.heads, head_dim=s.hidden // s.heads, num_kv_heads=s.kv_heads,
        rope_theta=10000, norm_eps=1e-6)
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    actor = llama_params.create_model_from_safe_tensors(model_dir, config, mesh)
    reference = llama_params.create_model_from_safe_tensors(model_dir, config, mesh)
    training = rl_cluster_lib.RLTrainingConfig(
        actor_optimizer=optax.adamw(job.lr), eval_every_n_steps=10**9, max_steps=job.steps,
        mini_batch_size=job.prompts_per_step, train_micro_batch_size=job.tunix_microbatch_prompts,
        rollout_micro_batch_size=job.prompts_per_step,
        compute_logps_micro_batch_size=job.prompts_per_step, pbar_description=None)
    rollout = base_rollout.RolloutConfig(
        max_tokens_to_generate=job.max_new_tokens, temperature=1.0, top_p=1.0, top_k=None,
        max_prompt_length=job.prompt_words + 1,
        kv_cache_size=job.prompt_words + 1 + job.max_new_tokens + 8,
        eos_tokens=[tokenizer.eos_token_id])
    cluster = rl_cluster_lib.RLCluster(
        actor=actor, reference=reference, tokenizer=tokenizer,
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={r: mesh for r in (rl_cluster_lib.Role.ACTOR,
                                             rl_cluster_lib.Role.REFERENCE,
                                             rl_cluster_lib.Role.ROLLOUT)},
            rollout_engine="vanilla", offload_to_cpu=False, training_config=training,
            rollout_config=rollout))
    generated = []

    def reward_fn(prompts, completions, **kwargs):
        generated.append(sum(len(tokenizer.encode(c)) for c in completions))
        return [reward(c) for c in completions]

    learner = grpo_learner.GrpoLearner(
        rl_cluster=cluster, reward_fns=reward_fn,
        algo_config=grpo_learner.GrpoConfig(num_generations=job.group_size, num_iterations=1,
                                            beta=0.0, epsilon=0.2))
    clock = Clock()
    clock.wrap(cluster, "generate", "generate_s")
    clock.wrap(cluster, "update_actor", "train_s",
               calls_per_step=job.prompts_per_step // job.tunix_microbatch_prompts)
    rows = prompts(job)
    n = job.prompts_per_step
    batches = [{"prompts": np.array(rows[i * n:(i + 1) * n])} for i in range(job.steps)]
    learner.train(batches)
    for row, tokens in zip(clock.rows, generated):
        row["generated_tokens"] = tokens
        row["samples"] = job.samples_per_step
    print("RESULT " + json.dumps(result(job, "Tunix", clock.rows, clock.rows[0]["wall_s"])))


if __name__ == "__main__":
    main(*sys.argv[1:])
