"""The tools (jaxrl/rl/tools.py): the calculator's arithmetic, and the Python evaluator's limits
(time, memory, output, network, processes, files outside its directory), each breach an error
observation, never an exception."""

import socket
import threading

import pytest

from jaxrl.rl.tools import ToolResult, calculator, run_python


@pytest.mark.parametrize("expression,want", [
    ("2+3*4", "14"), ("(7 - 10) * 3", "-9"), ("7/2", "3.5"), ("2**64", str(2**64)),
    ("10 // 3 + 10 % 3", "4"), ("-(-3)", "3"), ("1/3", "0.333333333333"), ("6/3", "2")])
def test_calculator_does_arithmetic(expression, want):
    assert calculator(expression) == ToolResult(True, want)


@pytest.mark.parametrize("expression,error", [
    ("1/0", "division by zero"), ("__import__('os')", "is not arithmetic"),
    ("2**100000", "exponent 100000 is above 1000"), ("1 +", "cannot evaluate"),
    ("x", "is not arithmetic"), ("9" * 300, "longer than 200 characters")])
def test_calculator_refuses_what_is_not_arithmetic(expression, error):
    result = calculator(expression)
    assert not result.ok and error in result.error
    assert result.observation().startswith("error: ")


def test_python_runs_code_and_returns_its_output():
    result = run_python("import math\nprint(math.factorial(20))\nprint(sum(range(10)))")
    assert result.ok and result.output == "2432902008176640000\n45\n"


def test_python_may_write_in_its_own_directory_and_read_anywhere():
    result = run_python("open('notes.txt', 'w').write('hi')\n"
                        "print(open('notes.txt').read(), len(open('/etc/hostname').read()) > 0)")
    assert result.ok and result.output == "hi True\n", result


@pytest.mark.parametrize("code,error", [
    ("while True: pass", "timed out after 2 s"),
    ("x = bytearray(10**9)", "MemoryError: more than 256 MB"),
    ("open('/tmp/jaxrl-escape.txt', 'w')", "PermissionError: writing '/tmp/jaxrl-escape.txt'"),
    ("import os\nos.system('true')", "PermissionError: os.system is not allowed"),
    ("import subprocess\nsubprocess.run(['true'])", "is not allowed here"),
    ("import os\nos.fork()", "PermissionError: os.fork is not allowed"),
    ("import ctypes", "PermissionError: import is not allowed"),
    ("raise ValueError('bad input')", "ValueError: bad input"),
    ("import sys\nsys.exit(3)", "exit status 3"),
])
def test_python_breaches_end_as_errors(code, error):
    result = run_python(code, timeout_s=2, memory_mb=256)
    assert not result.ok and error in result.error, result
    assert result.observation() == f"error: {result.error}"


def test_python_has_no_network():
    """A listener on 127.0.0.1 that a connection would reach: the code cannot connect."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(3)
    reached = []
    thread = threading.Thread(target=lambda: reached.append(_accept(server)))
    thread.start()
    port = server.getsockname()[1]
    result = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}))",
                        timeout_s=2)
    thread.join()
    server.close()
    assert not result.ok and "socket" in result.error and reached == [False]


def _accept(server) -> bool:
    try:
        server.accept()[0].close()
        return True
    except OSError:
        return False


def test_python_output_is_cut():
    result = run_python("print('x' * 10000)", max_output=100)
    assert result.ok and result.output.startswith("x" * 100)
    assert result.output.endswith("... [9901 more characters cut]")
