"""The demo task trained through the Tinker API: `make run`'s supervised warm-up checkpoint
served by `jaxrl tinker`, then an RL loop written against the tinker SDK (groups sampled from
the adapters just handed over, the task's reward, importance_sampling on group-normalised
advantages, optim_step), held-out greedy accuracy before and after, through the same sampler.
Runs in the client's process; prints one RESULT line of JSON.

    python learn.py --url URL --model NAME [--steps 400] [--prompts 32] [--group 8]
"""

import argparse
import json
import sys
import time

import numpy as np
import tinker
from tinker import types

from jaxrl.models.tokenizer import CharTokenizer, prompt_ids
from jaxrl.rl.tasks.arithmetic import ArithmeticTask


def accuracy(sampler, task, tok, problems) -> float:
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0, stop=[tok.eos_id])
    futures = [sampler.sample(types.ModelInput.from_ints(prompt_ids(tok, p.prompt)),
                              num_samples=1, sampling_params=greedy) for p in problems]
    answers = [tok.decode(f.result().sequences[0].tokens) for f in futures]
    return float(np.mean([task.score(p, a) == 1.0 for p, a in zip(problems, answers)]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--eval", type=int, default=200)
    a = p.parse_args()
    task, tok = ArithmeticTask(), CharTokenizer(ArithmeticTask.alphabet)
    held_out = task.held_out(a.eval)
    rng = np.random.default_rng(0)
    service = tinker.ServiceClient(base_url=a.url, api_key="tml-bench")
    training = service.create_lora_training_client(base_model=a.model, rank=a.rank,
                                                   seed=0).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    before = accuracy(sampler, task, tok, held_out)
    print(f"held-out accuracy before: {before:.3f}", file=sys.stderr, flush=True)
    params = types.SamplingParams(max_tokens=8, temperature=a.temperature, stop=[tok.eos_id])
    rows, t0 = [], time.perf_counter()
    for step in range(a.steps):
        problems = [task.sample(rng) for _ in range(a.prompts)]
        futures = [sampler.sample(types.ModelInput.from_ints(prompt_ids(tok, q.prompt)),
                                  num_samples=a.group, sampling_params=params)
                   for q in problems]
        data, rewards = [], []
        for q, f in zip(problems, futures):
            seqs = f.result().sequences
            scores = np.array([task.score(q, tok.decode(s.tokens)) for s in seqs])
            rewards += scores.tolist()
            adv = (scores - scores.mean()) / (scores.std() + 1e-6)
            prompt = prompt_ids(tok, q.prompt)
            for s, adv_s in zip(seqs, adv):
                if not s.tokens or adv_s == 0:
                    continue
                tokens = prompt + list(s.tokens)
                pad = [0.0] * (len(prompt) - 1)
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": tokens[1:],
                                    "logprobs": pad + list(s.logprobs),
                                    "advantages": pad + [float(adv_s) / a.prompts] *
                                    len(s.tokens)}))
        if data:
            training.forward_backward(data, "importance_sampling")
            training.optim_step(types.AdamParams(learning_rate=a.lr)).result()
        sampler = training.save_weights_and_get_sampling_client().result()
        rows.append({"step": step, "reward": float(np.mean(rewards))})
        if step % 10 == 0:
            print(f"step {step}: reward {rows[-1]['reward']:.3f}", file=sys.stderr, flush=True)
    after = accuracy(sampler, task, tok, held_out)
    print(f"held-out accuracy after: {after:.3f}", file=sys.stderr, flush=True)
    print("RESULT " + json.dumps({"before": before, "after": after, "steps": rows,
                                  "loop_s": time.perf_counter() - t0}), flush=True)


if __name__ == "__main__":
    main()
