"""Tools a model may call during an episode, with limits: a calculator and a small Python
evaluator. A tool never raises into the caller: a bad call, a crash, a timeout or a breach of
its limits comes back as a `ToolResult` with `ok=False` and an error the model can read (the
environment turns it into an observation; the run goes on).

The Python evaluator runs the code in a child process (`python -I`, a fresh temporary
directory as its working directory and home, an empty environment):
- time: `timeout_s` of wall time (the whole process group is killed), and CPU time a
  second past it as a backstop (threads can spend CPU faster than the clock);
- memory: `memory_mb` of address space (RLIMIT_AS), files written at most 1 MiB each;
- no network, no new processes, no writes outside its directory: an audit hook installed
  before the code runs refuses socket use, subprocess/exec/fork/os.system, and opening files
  for writing elsewhere (audit hooks cannot be removed from Python once added);
- output: stdout and stderr cut to `max_output` characters.
It is a guard for model-written snippets on a trusted machine, not a container: code that
reaches native code through ctypes could step around the hook (ctypes imports are refused for
that reason, but a determined adversary should meet a real sandbox).
"""

from __future__ import annotations

import ast
import dataclasses
import math
import operator
import os
import resource
import signal
import subprocess
import sys
import tempfile


@dataclasses.dataclass(frozen=True)
class ToolResult:
    ok: bool
    output: str              # what the tool printed or returned ("" on failure)
    error: str | None = None  # why it failed, for the model to read

    def observation(self) -> str:
        return self.output if self.ok else f"error: {self.error}"


# -- calculator ----------------------------------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_POWER = 1000


def calculator(expression: str, max_length: int = 200) -> ToolResult:
    """Integer and decimal arithmetic (+ - * / // % ** and parentheses), evaluated from the
    syntax tree (never `eval`); integers print exactly, fractions to 12 significant digits."""
    if len(expression) > max_length:
        return ToolResult(False, "", f"expression longer than {max_length} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
        value = _evaluate(tree.body)
    except ZeroDivisionError:
        return ToolResult(False, "", "division by zero")
    except (SyntaxError, ValueError, TypeError, OverflowError) as e:
        return ToolResult(False, "", f"cannot evaluate {expression!r}: {e}")
    if isinstance(value, float):
        if not math.isfinite(value):
            return ToolResult(False, "", "result is not finite")
        if value.is_integer() and abs(value) < 2**53:
            value = int(value)
        else:
            return ToolResult(True, f"{value:.12g}")
    return ToolResult(True, str(value))


def _evaluate(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_POWER:
            raise ValueError(f"exponent {right} is above {_MAX_POWER}")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"{ast.dump(node)[:60]} is not arithmetic")


# -- Python ----------------------------------------------------------------------------------------

# Runs first in the child: the audit hook that keeps the code in its directory and off the
# network, then the code itself from stdin.
_GUARD = r"""
import os, sys
_home = os.path.realpath(os.getcwd())
_blocked = ("socket.", "subprocess.", "os.system", "os.exec", "os.fork", "os.posix_spawn",
            "os.spawn", "os.kill", "pty.", "ctypes.", "os.remove", "os.rename", "os.rmdir",
            "shutil.rmtree", "os.chmod", "os.symlink", "os.link")
def _hook(event, args):
    if event.startswith(_blocked) or event == "import" and args[0] == "ctypes":
        raise PermissionError(f"{event} is not allowed here")
    if event == "open" and len(args) > 1 and args[0] is not None:
        mode, flags = args[1], args[2] if len(args) > 2 else 0
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        path = args[0]
        if writing and not isinstance(path, int):
            real = os.path.realpath(os.fsdecode(path))
            if not (real == _home or real.startswith(_home + os.sep)):
                raise PermissionError(f"writing {real!r} is not allowed here")
sys.addaudithook(_hook)
del _hook
_source = sys.stdin.read()
exec(compile(_source, "<tool>", "exec"), {"__name__": "__main__"})
"""


def cpu_limit(timeout_s: float) -> int:
    return int(math.ceil(timeout_s)) + 1


def run_python(code: str, timeout_s: float = 5.0, memory_mb: int = 512,
               max_output: int = 4096) -> ToolResult:
    """Runs `code` under the limits above; returns what it printed (stdout, then stderr)."""
    with tempfile.TemporaryDirectory(prefix="jaxrl-tool-") as home:
        def limits():
            os.setsid()
            # a backstop past the wall-clock timeout (which a single thread reaches first)
            cpu = cpu_limit(timeout_s)
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
            resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
            resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

        env = {"HOME": home, "TMPDIR": home, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8",
               "PYTHONHASHSEED": "0"}
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-B", "-c", _GUARD], cwd=home, env=env,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, preexec_fn=limits)
        except OSError as e:
            return ToolResult(False, "", f"could not start Python: {e}")
        try:
            out, err = proc.communicate(code.encode(), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return ToolResult(False, "", f"timed out after {timeout_s:g} s")
    text = (out.decode(errors="replace") + err.decode(errors="replace"))
    if len(text) > max_output:
        text = text[:max_output] + f"... [{len(text) - max_output} more characters cut]"
    if proc.returncode == 0:
        return ToolResult(True, text)
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        why = {"SIGXCPU": f"CPU time above {cpu_limit(timeout_s)} s", "SIGKILL": "killed",
               "SIGXFSZ": "a file above 1 MiB"}.get(name, name)
        return ToolResult(False, text, f"stopped: {why}")
    last = err.decode(errors="replace").strip().splitlines()
    reason = last[-1] if last else f"exit status {proc.returncode}"
    if "MemoryError" in reason:
        reason = f"MemoryError: more than {memory_mb} MB"
    return ToolResult(False, text, reason)
