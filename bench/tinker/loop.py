"""One RL loop written against the tinker SDK, as a researcher writes it: each step hands the
adapters to a sampler, samples a group per prompt, rewards it, importance_sampling
forward_backward on the sampler's log-probs, optim_step. Standard library and the SDK only (it
runs in each service's own environment, SDK 0.16 or 0.38); token ids in and out, so no
tokenizer differs between stacks. Prints one RESULT line of JSON.

    python loop.py --url URL --model NAME --steps 6 --prompts 4 --group 8 --max-tokens 32
"""

import argparse
import json
import random
import sys
import time

import tinker
from tinker import types

sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/peers")
from job import SPECIALS, WORDS  # noqa: E402


def ready(x):
    """The SDK 0.38 hands futures of clients (call .result()); 0.16 the clients."""
    return x.result() if type(x).__name__.startswith("Backcompat") else x


def reward(tokens: list[int]) -> float:
    """bench/peers/job.py's reward on token ids: the share of even-numbered words."""
    words = [t - len(SPECIALS) for t in tokens if t >= len(SPECIALS)]
    return sum(w % 2 == 0 for w in words) / len(tokens) if tokens else 0.0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    a = p.parse_args()
    rng = random.Random(0)
    bos = SPECIALS.index("<s>")
    prompts = [[bos] + [len(SPECIALS) + rng.randrange(WORDS) for _ in range(a.prompt_tokens)]
               for _ in range(a.prompts * a.steps)]
    service = tinker.ServiceClient(base_url=a.url, api_key="tml-bench")
    t0 = time.perf_counter()
    training = ready(service.create_lora_training_client(base_model=a.model, rank=a.rank,
                                                         seed=0))
    created = time.perf_counter() - t0
    steps = []
    for step in range(a.steps):
        start = time.perf_counter()
        sampler = ready(training.save_weights_and_get_sampling_client())
        params = types.SamplingParams(max_tokens=a.max_tokens, temperature=1.0, seed=step)
        batch = prompts[step * a.prompts:(step + 1) * a.prompts]
        futures = [sampler.sample(types.ModelInput.from_ints(q), num_samples=a.group,
                                  sampling_params=params) for q in batch]
        groups = [f.result().sequences for f in futures]
        sampled = time.perf_counter()
        data, rewards, trained = [], [], 0
        for prompt, seqs in zip(batch, groups):
            scores = [reward(list(s.tokens)) for s in seqs]
            mean = sum(scores) / len(scores)
            rewards += scores
            for s, r in zip(seqs, scores):
                tokens = prompt + list(s.tokens)
                pad = [0.0] * (len(prompt) - 1)
                trained += len(tokens) - 1
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": tokens[1:],
                                    "logprobs": pad + list(s.logprobs),
                                    "advantages": pad + [r - mean] * len(s.tokens)}))
        fwd_bwd = training.forward_backward(data, "importance_sampling")
        optim = training.optim_step(types.AdamParams(learning_rate=a.lr))
        fwd_bwd.result()
        optim.result()
        end = time.perf_counter()
        steps.append({"wall_s": end - start, "sample_s": sampled - start,
                      "train_s": end - sampled,
                      "sampled_tokens": sum(len(s.tokens) for g in groups for s in g),
                      "trained_tokens": trained, "reward": sum(rewards) / len(rewards)})
        print(f"step {step}: {end - start:.2f} s, reward {steps[-1]['reward']:.3f}",
              file=sys.stderr, flush=True)
    print("RESULT " + json.dumps({"create_s": created, "steps": steps}), flush=True)


if __name__ == "__main__":
    main()
