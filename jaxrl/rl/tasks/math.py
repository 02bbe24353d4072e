"""Math word problems (GSM8K, MATH) from local JSONL, JSON or parquet files, scored by math_verify.

The reference answer is the final answer only: GSM8K's text after `####` (commas dropped), MATH's
last \\boxed{...}. A completion scores 1 when math_verify finds an expression in it equal to that
answer, so `\\boxed{1,200}`, `The answer is 1200.` and `0.5` for `\\frac{1}{2}` all count.

math_verify bounds each parse and comparison with SIGALRM, which Python allows only in the main
thread (elsewhere math_verify raises). Off the main thread, `score` therefore hands the check to a
child process, which runs it under those alarms, and kills the child if it outlives a backstop
besides: a signal cannot interrupt a long call inside C code, nor save a child out of memory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import select
import subprocess
import sys
import threading
import weakref
from pathlib import Path
from typing import Literal

import numpy as np

from jaxrl.rl.tasks.base import Problem
from jaxrl.rl.tasks.rows import EXTENSIONS, TaskDataError, is_held_out, read_rows

DEFAULT_PROMPT = ("{question}\n"
                  "Please reason step by step, and put your final answer within \\boxed{{}}.")
# Auto-detected columns: (question key, answer key) -> where the final answer sits in the answer.
KNOWN_KEYS = {("question", "answer"): "gsm8k", ("problem", "solution"): "math"}


@dataclasses.dataclass(frozen=True)
class MathConfig:
    """Where the problems are and how they are posed. Files are read when the task is built."""

    name: Literal["math"] = "math"  # GSM8K/MATH-style problem files, graded with math-verify
    train_path: str = ""            # .jsonl / .json / .parquet of training problems
    eval_path: str = ""             # held-out problems; "" = a hash-selected share of train_path
    held_out_percent: int = 5       # that share, when eval_path is ""
    prompt_template: str = DEFAULT_PROMPT  # has {question}; literal braces doubled: \boxed{{}}
    question_key: str = ""          # columns of both files; "" = auto: GSM8K's question/answer or
    answer_key: str = ""            # MATH's problem/solution. A named answer may be bare ("7")
    max_problems: int = 0           # read only the first this-many rows of each file; 0 = all
    verify_timeout_s: int = 5       # math_verify's limit on each parse and each comparison

    def __post_init__(self):
        if "{question}" not in self.prompt_template:
            raise ValueError(f"task.prompt_template={self.prompt_template!r} must contain "
                             "'{question}'")
        try:
            self.prompt_template.format(question="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"task.prompt_template={self.prompt_template!r} is not a valid "
                             f"format string ({e!r}); its only field may be {{question}}, and "
                             "literal braces are written doubled, as in \\boxed{{}}") from e
        if not 1 <= self.held_out_percent <= 50:
            raise ValueError(f"task.held_out_percent={self.held_out_percent} must be in [1, 50]")
        if bool(self.question_key) != bool(self.answer_key):
            raise ValueError(f"task.question_key={self.question_key!r} and task.answer_key="
                             f"{self.answer_key!r} must both be set or both be '' (auto-detect)")
        if self.max_problems < 0:
            raise ValueError(f"task.max_problems={self.max_problems} must be >= 0 (0 = all)")
        if self.verify_timeout_s < 1:
            raise ValueError(f"task.verify_timeout_s={self.verify_timeout_s} must be >= 1 "
                             "(math_verify's alarm counts whole seconds)")


# ---------------------------------------------------------------------------------------------
# Loading.

def last_boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...} or \\fbox{...} (braces balanced), else None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:].removeprefix("\\boxed").removeprefix("\\fbox")
    if not rest.startswith("{"):
        bare = re.match(r"\s+([^\s$]+)", rest)  # the brace-less form `\boxed 5`
        return bare.group(1) if bare else None
    depth = 0
    for i, ch in enumerate(rest):
        depth += (ch == "{") - (ch == "}")
        if depth == 0:
            return rest[1:i].strip() or None
    return None


def _final_answer(text: str, style: str, where: str) -> str:
    if style == "gsm8k" or (style == "named" and "####" in text):
        answer = text.rpartition("####")[2].strip().replace(",", "")
        if "####" not in text or not answer:
            raise TaskDataError(f"{where}: the GSM8K answer has no final answer after '####'")
        return answer
    if style == "math" or "\\boxed" in text or "\\fbox" in text:
        answer = last_boxed(text)
        if answer is None:
            raise TaskDataError(f"{where}: the MATH solution has no complete \\boxed{{...}} "
                                "final answer")
        return answer
    if not text.strip():
        raise TaskDataError(f"{where}: the answer is empty")
    return text.strip()


def load_problems(path: Path, cfg: MathConfig) -> list[tuple[str, Problem]]:
    """(question, problem) pairs from one file."""
    rows = read_rows(path)
    if cfg.max_problems:
        rows = rows[:cfg.max_problems]
    if not rows:
        raise TaskDataError(f"task data file {path} is empty")
    if cfg.question_key:
        keys, style = (cfg.question_key, cfg.answer_key), "named"
    else:
        first = rows[0][1]
        found = [k for k in KNOWN_KEYS if isinstance(first, dict) and set(k) <= first.keys()]
        keys, style = (found[0], KNOWN_KEYS[found[0]]) if found else ((), "")
    out = []
    for n, row in rows:
        if not isinstance(row, dict):
            raise TaskDataError(f"{path} row {n} is a {type(row).__name__}, not an object")
        if not keys or any(row.get(k) is None for k in keys):
            wanted = " and ".join(map(repr, keys)) if keys else \
                " or ".join(f"{q!r}/{a!r}" for q, a in KNOWN_KEYS)
            raise TaskDataError(f"{path} row {n} lacks {wanted} (its keys: {sorted(row)}); "
                                "name the columns with task.question_key and task.answer_key")
        question = str(row[keys[0]]).strip()
        answer = _final_answer(str(row[keys[1]]), style, f"{path} row {n}")
        out.append((question, Problem(cfg.prompt_template.format(question=question), answer)))
    return out


# ---------------------------------------------------------------------------------------------
# Scoring.

def _math_verify():
    """math_verify's (parse, verify, TimeoutException), imported on first use: it brings sympy,
    a third of a second at the start of every run that never scores math."""
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    return parse, verify, TimeoutException


def _verify(answer: str, completion: str, timeout_s: int) -> bool:
    """math_verify's check of `completion` against the final `answer`. Uses SIGALRM, so it must
    run in a main thread; never raises on any completion."""
    parse, verify, TimeoutException = _math_verify()
    try:
        gold = parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout_s)
        pred = parse(completion, parsing_timeout=timeout_s)
        return bool(gold and pred and verify(gold, pred, timeout_seconds=timeout_s))
    except (Exception, TimeoutException):  # TimeoutException is a BaseException
        return False


def serve_checks(timeout_s: int) -> None:
    """The worker process: JSON [answer, completion] lines in, "1" or "0" lines out, until EOF."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything else printed goes to stderr, not into the replies
    _math_verify()   # before "ready": the first check's backstop must not time the import
    print("ready", file=replies, flush=True)
    for line in sys.stdin:
        answer, completion = json.loads(line)
        print(int(_verify(answer, completion, timeout_s)), file=replies, flush=True)


class VerifyWorker:
    """Runs `_verify` in a child process's main thread, one check at a time. A check that outlives
    `backstop_s` (a hang in C code, memory exhaustion) scores 0 and the child is replaced.

    The child is a fresh interpreter, not a multiprocessing one: forking is unsafe once JAX runs
    threads, and spawn re-runs the parent's `__main__`, which breaks unguarded scripts."""

    def __init__(self, timeout_s: int, backstop_s: float):
        self.timeout_s, self.backstop_s = timeout_s, backstop_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None

    def _start(self) -> None:
        root = str(Path(__file__).resolve().parents[3])  # where `import jaxrl` works
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        code = ("import sys; from jaxrl.rl.tasks.math import serve_checks; "
                "serve_checks(int(sys.argv[1]))")
        self._proc = subprocess.Popen([sys.executable, "-c", code, str(self.timeout_s)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                      env=env)
        weakref.finalize(self, self._proc.kill)
        if self._reply(timeout=60) != "ready":
            self._stop()
            raise RuntimeError("the math_verify worker process did not start (see its stderr)")

    def _reply(self, timeout: float) -> str | None:
        """The child's next line, or None if it sends none within `timeout` seconds."""
        if not select.select([self._proc.stdout], [], [], timeout)[0]:
            return None
        return self._proc.stdout.readline().strip() or None  # "" is EOF: the child died

    def _stop(self) -> None:
        self._proc.kill()
        self._proc.wait()
        self._proc.stdin.close()
        self._proc.stdout.close()
        self._proc = None

    def verify(self, answer: str, completion: str) -> bool:
        with self._lock:
            if self._proc is not None and self._proc.poll() is not None:
                self._stop()
            if self._proc is None:
                self._start()
            try:
                self._proc.stdin.write(json.dumps([answer, completion]) + "\n")
                self._proc.stdin.flush()
                reply = self._reply(self.backstop_s)
            except OSError:  # the child died before reading the check
                reply = None
            if reply is None:
                self._stop()
            return reply == "1"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None


# ---------------------------------------------------------------------------------------------
# The task.

class MathTask:
    name = "math"

    def __init__(self, cfg: MathConfig = MathConfig()):
        self.cfg = cfg
        if not cfg.train_path:
            raise TaskDataError("task.train_path is not set; give a file of problems ("
                                f"{', '.join(EXTENSIONS)})")
        problems = load_problems(Path(cfg.train_path), cfg)
        if cfg.eval_path:
            held = load_problems(Path(cfg.eval_path), cfg)
            held_questions = {q for q, _ in held}
            train = [(q, p) for q, p in problems if q not in held_questions]
            if not train:
                raise TaskDataError(f"every problem of task.train_path={cfg.train_path} is also "
                                    f"in task.eval_path={cfg.eval_path}")
        else:
            train = [(q, p) for q, p in problems if not self._is_held_out(q)]
            held = [(q, p) for q, p in problems if self._is_held_out(q)]
            if not held or not train:
                raise TaskDataError(
                    f"holding out {cfg.held_out_percent}% of the {len(problems)} problems in "
                    f"{cfg.train_path} leaves {'no evaluation' if not held else 'no training'} "
                    "problems; set task.eval_path or change task.held_out_percent")
        self._train = [p for _, p in train]
        self._eval = [p for _, p in held]
        # Twice a check's worst case: two parses and up to four comparisons, each alarm-bounded.
        self._worker = VerifyWorker(cfg.verify_timeout_s, backstop_s=12 * cfg.verify_timeout_s)

    def _is_held_out(self, question: str) -> bool:
        return is_held_out(question, self.cfg.held_out_percent)

    def __len__(self) -> int:
        """Training problems."""
        return len(self._train)

    def sample(self, rng: np.random.Generator) -> Problem:
        return self._train[int(rng.integers(len(self._train)))]

    warmup_sample = sample   # the warm-up sees the whole problem space

    def held_out(self, n: int) -> list[Problem]:
        """The first `n` evaluation problems in file order (all of them if there are fewer)."""
        return self._eval[:max(n, 0)]

    def score(self, problem: Problem, completion: str) -> float:
        if threading.current_thread() is threading.main_thread():
            return float(_verify(problem.answer, completion, self.cfg.verify_timeout_s))
        return float(self._worker.verify(problem.answer, completion))
