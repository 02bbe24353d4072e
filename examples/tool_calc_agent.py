"""An agent written against the plain `openai` package for the calculator task: it keeps its
own transcript, calls its own calculator, and names a trajectory per episode (the `user`
field), so the server records exactly the tokens the model sampled.

Against `jaxrl serve --http-port`, it runs a few episodes greedily, reading each trajectory back
(tokens, which of them the model wrote, their log-probs and weights versions: what a trainer
trains on) and ending it:

    jaxrl train --config configs/tool_calc_cpu.yaml            # or any checkpoint of the task
    jaxrl serve --checkpoint runs/tool_calc/checkpoints --http-port 8000 \
        --max-len 64 &
    python examples/tool_calc_agent.py --url http://127.0.0.1:8000/v1 --episodes 8

With `--worker`, `jaxrl train` runs it as the source of its RL episodes (jaxrl/rollout/agents.py):

    jaxrl train --config configs/tool_calc_cpu.yaml \
        'rl.agent.command=[python, examples/tool_calc_agent.py, --worker]'

Nothing in it is specific to jaxrl but the trajectory URL and the worker's JSON lines: the same
episode loop works against any OpenAI-compatible server.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import json
import operator
import os
import random
import sys
import threading
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


def episode(client: openai.OpenAI, prompt: str, key: str, *, max_turns: int = 4,
            max_tokens: int = 10, temperature: float = 0.0) -> dict:
    """One episode of `prompt` (e.g. "37*45+12="), recorded into trajectory `key`."""
    transcript, reward, calls, errors, finish = prompt, 0.0, 0, 0, "turns"
    for _ in range(max_turns):
        try:
            turn = client.completions.create(model="jaxrl", prompt=transcript,
                                             max_tokens=max_tokens, temperature=temperature,
                                             stop=[";"],
                                             extra_headers={"X-Trajectory-Id": key})
        except openai.BadRequestError:     # the episode has no room left for a turn
            finish = "length"
            break
        text = turn.choices[0].text
        if text.startswith("a"):
            reward = float(text[1:] == calculator(prompt.rstrip("=")))
            transcript, finish = transcript + text, "done"
            break
        result = calculator(text[1:]) if text.startswith("c") else "?"
        calls += text.startswith("c")
        errors += text.startswith("c") and result == "?"
        transcript += f"{text};={result};"
    return {"transcript": transcript, "reward": reward, "finish": finish, "tool_calls": calls,
            "tool_errors": errors}


def serve_episodes(client: openai.OpenAI, concurrency: int) -> None:
    """`jaxrl train` with rl.agent.command: episodes arrive as JSON lines on stdin, each
    report leaves as one JSON line on stdout (jaxrl/rollout/agents.py), several at once."""
    lock = threading.Lock()

    def run(line: str) -> None:
        job = json.loads(line)
        try:
            e = episode(client, job["problem"]["prompt"], job["id"],
                        max_turns=job["max_turns"], max_tokens=job["max_tokens"],
                        temperature=job["temperature"])
            report = {"id": job["id"], **{k: e[k] for k in (
                "reward", "finish", "tool_calls", "tool_errors")}}
        except openai.OpenAIError as err:          # e.g. the episode outgrew the context
            report = {"id": job["id"], "error": str(err)}
        with lock:
            print(json.dumps(report), flush=True)

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for line in sys.stdin:
            if line.strip():
                pool.submit(run, line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=os.environ.get("OPENAI_BASE_URL",
                                                        "http://127.0.0.1:8000/v1"))
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", action="store_true",
                        help="take episodes from stdin, as `jaxrl train` with rl.agent does")
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.url, api_key=os.environ.get("OPENAI_API_KEY", "-"),
                           max_retries=0, timeout=600)
    if args.worker:
        serve_episodes(client, args.concurrency)
        return
    rng = random.Random(args.seed)
    solved = 0
    for _ in range(args.episodes):
        prompt = f"{rng.randint(10, 99)}*{rng.randint(10, 99)}+{rng.randint(10, 99)}="
        key = f"agent-{uuid.uuid4().hex[:12]}"
        e = episode(client, prompt, key)
        record = httpx.delete(f"{args.url}/trajectories/{key}").json()   # read back and end
        model = sum(record["trained"])
        others = len(record["prompt"]) + len(record["trained"]) - model
        solved += e["reward"] >= 1
        print(f"{e['transcript']:<44} reward {e['reward']:.0f}  model tokens {model}, "
              f"others {others}, versions {sorted(set(record['versions']))}")
    print(f"solved {solved}/{args.episodes}")


if __name__ == "__main__":
    main()
