"""Held-out accuracy of a model on a task (greedy decoding)."""

from __future__ import annotations

from jaxrl.models.generate import greedy_generate
from jaxrl.models.tokenizer import Tokenizer
from jaxrl.models.transformer import Transformer
from jaxrl.rl.tasks.base import Task


def evaluate(model: Transformer, task: Task, tokenizer: Tokenizer, num_problems: int,
             max_new_tokens: int = 8, batch_size: int = 256) -> dict:
    """{"accuracy", "problems", "examples"}: the share of held-out problems answered exactly."""
    problems = task.held_out(num_problems)
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    scores, examples = [], []
    for start in range(0, len(problems), batch_size):
        chunk = problems[start: start + batch_size]
        prompts = [bos + tokenizer.encode(p.prompt) for p in chunk]
        for problem, ids in zip(chunk, greedy_generate(model, prompts, max_new_tokens,
                                                       tokenizer.eos_id)):
            completion = tokenizer.decode(ids)
            scores.append(float(task.score(problem, completion) >= 1.0))
            if len(examples) < 5:
                examples.append(f"{problem.prompt}{completion}")
    accuracy = sum(scores) / max(len(scores), 1)
    return {"accuracy": accuracy, "problems": len(scores), "examples": examples}
