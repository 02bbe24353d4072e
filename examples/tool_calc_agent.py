"""An agent written against the plain `openai` package, driving the calculator task through
`jaxrl serve --http-port`: it keeps its own transcript, calls its own calculator, and names a
trajectory per episode (the `user` field), so the server records exactly the tokens the model
sampled. At the end of each episode it reads the trajectory back (tokens, which of them the
model wrote, their log-probs and weights versions: what the trainer trains on) and ends it.

    jaxrl train --config configs/tool_calc_cpu.yaml            # or any checkpoint of the task
    jaxrl serve --checkpoint runs/tool_calc/checkpoints --http-port 8000 \
        --max-prefill-length 63 --max-len 64 &
    python examples/tool_calc_agent.py --url http://127.0.0.1:8000/v1 --episodes 8

Nothing in it is specific to jaxrl but the trajectory URL: the same loop works against any
OpenAI-compatible server.
"""

from __future__ import annotations

import argparse
import ast
import operator
import random
import uuid

import httpx
import openai

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculator(expression: str) -> str:
    """The agent's own tool: + - * on integers, or "?" for anything else."""
    def value(node):
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        raise ValueError(expression)
    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, RecursionError):
        return "?"


def episode(client: openai.OpenAI, base_url: str, a: int, b: int, c: int,
            max_turns: int = 4) -> dict:
    key = f"agent-{uuid.uuid4().hex[:12]}"
    transcript, reward = f"{a}*{b}+{c}=", 0.0
    for _ in range(max_turns):
        turn = client.completions.create(model="jaxrl", prompt=transcript, max_tokens=10,
                                         temperature=0.0, stop=[";"], user=key)
        text = turn.choices[0].text
        if text.startswith("a"):
            reward = float(text[1:] == str(a * b + c))
            transcript += text
            break
        result = calculator(text[1:]) if text.startswith("c") else "?"
        transcript += f"{text};={result};"
    record = httpx.delete(f"{base_url}/trajectories/{key}").json()   # read back and end
    return {"transcript": transcript, "reward": reward,
            "model_tokens": sum(record["trained"]),
            "other_tokens": len(record["prompt"]) + len(record["trained"])
            - sum(record["trained"]), "versions": sorted(set(record["versions"]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.url, api_key="unused")
    rng = random.Random(args.seed)
    solved = 0
    for _ in range(args.episodes):
        e = episode(client, args.url, rng.randint(10, 99), rng.randint(10, 99),
                    rng.randint(10, 99))
        solved += e["reward"] >= 1
        print(f"{e['transcript']:<44} reward {e['reward']:.0f}  model tokens "
              f"{e['model_tokens']}, others {e['other_tokens']}, versions {e['versions']}")
    print(f"solved {solved}/{args.episodes}")


if __name__ == "__main__":
    main()
