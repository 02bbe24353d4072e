"""A multi-turn task that needs a tool: arithmetic chains such as `37*45+12=` that a small model
cannot compute in its head but can solve by calling a calculator, one operation per turn.

An episode, turns ending in `;` (the turn's stop token) and the answer in EOS:

    prompt       37*45+12=
    model        c37*45;          a calculator call
    environment  =1665;           its result (a failed call: =?;)
    model        c1665+12;
    environment  =1677;
    model        a1677<eos>       the answer: reward 1 if right, the episode ends

The reply is a pure function of the problem and the model's turns (jaxrl/rl/env.py). The
supervised warm-up imitates worked episodes (`Problem.answer` is the whole exchange after the
prompt); RL then trains on the model's own episodes, its environment tokens masked out.
A fixed hash-selected share of problems is held out, as in the arithmetic task.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Literal, Sequence

import numpy as np

from jaxrl.errors import UserError
from jaxrl.rl.env import Reply
from jaxrl.rl.tasks.base import Problem
from jaxrl.rl.tools import calculator


@dataclasses.dataclass(frozen=True)
class ToolCalcConfig:
    name: Literal["toolcalc"] = "toolcalc"  # a chain of operations solved by calling a calculator tool
    min_operand: int = 10                   # smallest operand drawn
    max_operand: int = 99                   # largest operand drawn
    ops: tuple[str, ...] = ("*", "+")       # the chain's operations, left to right
    held_out_percent: int = 5               # share of problems reserved for evaluation

    def __post_init__(self):
        if not 0 <= self.min_operand <= self.max_operand:
            raise ValueError(f"task.min_operand={self.min_operand} must be in "
                             f"[0, task.max_operand={self.max_operand}]")
        bad = [op for op in self.ops if op not in "+-*"]
        if bad or not self.ops:
            raise ValueError(f"task.ops={list(self.ops)} must be a non-empty list of '+', '-', '*'")
        if not 1 <= self.held_out_percent <= 50:
            raise ValueError(f"task.held_out_percent={self.held_out_percent} must be in [1, 50]")


class ToolCalcTask:
    name = "toolcalc"
    alphabet = "0123456789+-*=ca;?"
    turn_stop = ";"

    def __init__(self, cfg: ToolCalcConfig = ToolCalcConfig()):
        self.cfg = cfg

    # -- problems ------------------------------------------------------------------------------
    def _operands(self, rng: np.random.Generator) -> tuple[int, ...]:
        return tuple(int(x) for x in rng.integers(self.cfg.min_operand, self.cfg.max_operand + 1,
                                                  size=len(self.cfg.ops) + 1))

    def _is_held_out(self, operands) -> bool:
        digest = hashlib.blake2b(repr(operands).encode(), digest_size=4).digest()
        return int.from_bytes(digest, "little") % 100 < self.cfg.held_out_percent

    def _problem(self, operands) -> Problem:
        prompt = str(operands[0])
        for op, x in zip(self.cfg.ops, operands[1:]):
            prompt += f"{op}{x}"
        return Problem(prompt=prompt + "=", answer=self._worked(operands))

    def _worked(self, operands) -> str:
        """The worked episode after the prompt: one call per operation, then the answer."""
        value, out = operands[0], ""
        for op, x in zip(self.cfg.ops, operands[1:]):
            call = f"{value}{op}{x}"
            value = int(calculator(call).output)
            out += f"c{call};={value};"
        return out + f"a{value}"

    def sample(self, rng: np.random.Generator) -> Problem:
        while True:
            operands = self._operands(rng)
            if not self._is_held_out(operands):
                return self._problem(operands)

    warmup_sample = sample

    def held_out(self, n: int) -> list[Problem]:
        rng = np.random.default_rng(12345)
        out, seen = [], set()
        for _ in range(1000 * n + 10_000):
            if len(out) == n:
                return out
            operands = self._operands(rng)
            if self._is_held_out(operands) and operands not in seen:
                seen.add(operands)
                out.append(self._problem(operands))
        raise UserError(f"train.eval_problems={n}: task.min_operand..max_operand leave too few "
                        f"held-out problems")

    def max_text_length(self) -> int:
        top = (self.cfg.max_operand,) * (len(self.cfg.ops) + 1)
        return len(self._problem(top).prompt) + len(self._worked(top)) + 4

    # -- the environment -----------------------------------------------------------------------
    @staticmethod
    def _value(problem: Problem) -> str:
        return problem.answer.rsplit("a", 1)[1]

    def reply(self, problem: Problem, turns: Sequence[str]) -> Reply:
        turn = turns[-1].rstrip(";")
        if turn.startswith("a"):
            return Reply(reward=float(turn[1:] == self._value(problem)), done=True)
        if turn.startswith("c"):
            result = calculator(turn[1:])
            if result.ok and result.output.lstrip("-").isdigit():
                return Reply(f"={result.output};", tool_call=True)
            return Reply("=?;", tool_call=True, tool_error=True)
        return Reply("=?;")

    def score(self, problem: Problem, completion: str) -> float:
        """The reward of a finished episode's text after the prompt: its last answer right."""
        answers = [t for t in completion.split(";") if t.startswith("a")]
        return float(bool(answers) and answers[-1][1:] == self._value(problem))
