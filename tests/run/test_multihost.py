"""`jaxrl train` as four processes on jax.distributed (127.0.0.1, gloo collectives, 2 CPU devices
each: one global fsdp=4 x tensor=2 mesh, fsdp across the processes) against one process with 8
devices: the same warm-up, step by step (loss and gradient norm, relative 1e-6) and in its final
parameters; each process built only its own rows of every batch; the checkpoint the four wrote
together restores in one process with plain Orbax.

Then RL on from that checkpoint, still in four processes, generating on two `jaxrl serve`
subprocesses that pull each version's weights from process 0 over jax.experimental.transfer:
process 0 leads (actor, pushes, metrics), the others train beside it. Part-way, one server is
SIGKILLed (its groups go to the other) and, after a checkpoint, all four trainer processes are
SIGKILLed and started again: they resume from the checkpoint and finish the run on the server
left, every step trained once, no sample lost. And a process 0 that cannot reach its fleet
stops the others with it instead of leaving them waiting (two processes, from the four's
checkpoint)."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from jaxrl.telemetry.metrics import read_metrics
from tests.xla import xla_flags

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6
ARGS = ["--config", str(ROOT / "configs/demo_cpu.yaml"), "model.embed_dim=32",
        "model.num_layers=2", "model.mlp_dim=64", f"train.steps={STEPS}",
        "train.batch_size=16", "train.microbatches=2", "train.log_every=1",
        "train.eval_problems=0", "checkpoint.every=3", "rl.steps=0", "log.progress=false",
        "mesh.fsdp=4", "mesh.tensor=2"]


RL = ["rl.steps=4", "rl.prompts_per_step=4", "rl.group_size=4",
      "rl.engine.max_concurrent_decodes=16",
      "rl.microbatch_rows=8", "checkpoint.resume=true", "rl.generation.heartbeat_s=0.5",
      "rl.generation.heartbeat_timeout_s=5"]
# The RL run sends its weights device to device (serving/weights/transfer.py); the fleet test takes
# the default (tcp, its servers being on this host).
RL_TRANSFER = ["rl.generation.transfer=jax"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(run_dir: Path, devices: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": xla_flags(devices)}
    keys = {e.split("=")[0] for e in extra if "=" in e}
    args = [a for a in ARGS if a.split("=")[0] not in keys]     # `extra` overrides ARGS
    return subprocess.Popen([sys.executable, "-m", "jaxrl.cli", "train", *args,
                             f"run_dir={run_dir}", *extra], cwd=run_dir.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def finish(proc: subprocess.Popen, returncode: int = 0) -> str:
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == returncode, out[-4000:]
    return out


def processes(run_dir: Path, count: int, *extra: str) -> list[subprocess.Popen]:
    """`count` processes of one job, the 8 devices split evenly among them."""
    port = free_port()
    return [train(run_dir, 8 // count, "--coordinator", f"127.0.0.1:{port}", "--num-processes",
                  str(count), "--process-id", str(i), *extra) for i in range(count)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    one = tmp_path_factory.mktemp("one") / "run"
    four = tmp_path_factory.mktemp("four") / "run"
    outputs = [finish(p) for p in processes(four, 4)]
    single = finish(train(one, 8))
    return {"one": one, "four": four, "outputs": outputs, "single": single}


def test_four_processes_train_as_one_process_does(runs):
    want, got = read_metrics(runs["one"]), read_metrics(runs["four"])
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm", "token_accuracy", "tokens"):
        np.testing.assert_allclose([r[key] for r in got], [r[key] for r in want], rtol=1e-6,
                                   err_msg=key)


def test_process_zero_speaks_for_all(runs):
    leader, *others = runs["outputs"]
    assert ("mesh {'data': 1, 'stage': 1, 'fsdp': 4, 'expert': 1, 'context': 1, "
            "'tensor': 2}") in leader
    assert len(others) == 3
    for other in others:
        assert "jaxrl train" in leader and "jaxrl train" not in other      # the summary table
        assert "  loss " in leader and "  loss " not in other              # the step lines


def test_the_four_process_checkpoint_restores_in_one_process_with_plain_orbax(runs):
    """Both final checkpoints restored by plain Orbax in a process without jaxrl: the same
    parameters (relative 1e-5), and the same steps kept."""
    script = textwrap.dedent("""
        import json, sys
        import jax
        import numpy as np
        import orbax.checkpoint as ocp
        out = {}
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        for name in ("one", "four"):
            manager = ocp.CheckpointManager(sys.argv[1 if name == "one" else 2])
            step = manager.latest_step()
            # Saved on 8 devices of 4 processes: restored onto this process's one device,
            # shapes and dtypes from the checkpoint's own metadata.
            path = f"{sys.argv[1 if name == 'one' else 2]}/{step}/params"
            meta = ocp.StandardCheckpointer().metadata(path).item_metadata
            target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype,
                                                                 sharding=device), meta)
            params = manager.restore(step, args=ocp.args.Composite(
                params=ocp.args.StandardRestore(target))).params
            leaves = {"/".join(str(k) for k in path): np.asarray(v)
                      for path, v in jax.tree_util.tree_flatten_with_path(params)[0]}
            out[name] = {"steps": manager.all_steps(), "leaves": {k: v.tolist()
                          for k, v in leaves.items()}}
        assert not any(m.startswith(("jaxrl", "sharding", "serving")) for m in sys.modules)
        print(json.dumps(out))
    """)
    out = subprocess.run([sys.executable, "-c", script, str(runs["one"] / "checkpoints"),
                          str(runs["four"] / "checkpoints")], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    restored = json.loads(out.stdout.strip().splitlines()[-1])
    assert restored["one"]["steps"] == restored["four"]["steps"] == [3, 6]
    one, four = restored["one"]["leaves"], restored["four"]["leaves"]
    assert sorted(one) == sorted(four)
    for name in one:
        np.testing.assert_allclose(np.asarray(four[name]), np.asarray(one[name]), rtol=1e-6,
                                   atol=1e-7, err_msg=name)


RL_END = 12         # the RL run's last step (from the warm-up's 6)
SERVER_KILLED_AFTER, TRAINERS_KILLED_AFTER = 7, 8


def serve(checkpoints: Path, token: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "jaxrl.cli", "serve", "--checkpoint", str(checkpoints),
         "--port", "0", "--slots", "16", "--max-len", "15", "--max-prefill-length", "8",
         "--prefill-chunk", "8", "--page-size", "4", "--update-token-file", str(token)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""})


def _written(run_dir: Path, step: int) -> bool:
    try:
        return any(r.get("step") == step and "reward" in r for r in read_metrics(run_dir))
    except Exception:       # no metrics file yet
        return False


def _until(done, procs: list[subprocess.Popen], what: str, timeout: float = 600.0) -> None:
    """Waits for `done()`; fails at once if a trainer process ends first."""
    deadline = time.monotonic() + timeout
    while not done():
        ended = [p for p in procs if p.poll() is not None]
        assert not ended, (f"a trainer process ended (code {ended[0].returncode}) before "
                           f"{what}:\n{ended[0].stdout.read()[-3000:]}" if ended else "")
        assert time.monotonic() < deadline, f"no {what} in {timeout:.0f} s"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def rl_run(runs, tmp_path_factory):
    """RL steps 7..12 from the four-process warm-up's checkpoint, in four processes again, with
    two `jaxrl serve` processes (serving that checkpoint, each restored in its one process)
    generating. Server 1 is SIGKILLed once step 7 is written; the four trainer processes are
    SIGKILLed once step 8 is (checkpoints every step) and started again, resuming."""
    run_dir = tmp_path_factory.mktemp("four_rl") / "run"
    shutil.copytree(runs["four"] / "checkpoints", run_dir / "checkpoints")
    token = run_dir / "token"
    token.write_text("multihost-token")
    servers = [serve(run_dir / "checkpoints", token) for _ in range(2)]
    try:
        addresses = [_ready(server) for server in servers]
        fleet = [*(o for o in RL if not o.startswith("rl.steps=")), f"rl.steps={RL_END - STEPS}",
                 "checkpoint.every=1", *RL_TRANSFER,
                 f"rl.generation.servers={','.join(addresses)}",
                 f"rl.generation.token_file={token}"]
        killed = processes(run_dir, 4, *fleet)
        _until(lambda: _written(run_dir, SERVER_KILLED_AFTER), killed, "step 7")
        servers[1].kill()                                   # SIGKILL
        _until(lambda: _written(run_dir, TRAINERS_KILLED_AFTER), killed, "step 8")
        for p in killed:
            p.kill()
        killed_codes = [p.wait(60) for p in killed]
        killed_rows = [r["step"] for r in read_metrics(run_dir) if "reward" in r]
        outputs = [finish(p) for p in processes(run_dir, 4, *fleet)]
        from serving.fleet.client import RemoteGeneration
        remote = RemoteGeneration(addresses[0], rpc_timeout_s=30)
        served = remote.metrics()
        remote.close()
    finally:
        for server in servers:
            server.kill()
            server.wait(60)
    return {"run_dir": run_dir, "outputs": outputs, "served": served,
            "killed_codes": killed_codes, "killed_rows": killed_rows}


def _ready(server: subprocess.Popen) -> str:
    output = []
    for line in server.stdout:
        output.append(line)
        if "ready on" in line:
            import threading
            threading.Thread(target=server.stdout.read, daemon=True).start()   # keep it drained
            return line.split("ready on ")[1].split(": ")[0]
    raise AssertionError("jaxrl serve did not start:\n" + "".join(output)[-3000:])


def test_rl_in_four_processes_survives_a_killed_server_and_a_killed_trainer(rl_run):
    assert rl_run["killed_codes"] == [-9] * 4, rl_run["killed_codes"]
    assert rl_run["killed_rows"][:2] == [7, 8], rl_run["killed_rows"]
    leader, *others = rl_run["outputs"]
    assert "trainer on 8 device(s) in 4 processes" in leader, leader[-3000:]
    resumed = re.search(r"resumed RL from \S+/(\d+)", leader)
    assert resumed and int(resumed[1]) in (SERVER_KILLED_AFTER, TRAINERS_KILLED_AFTER), \
        leader[-3000:]          # the newest checkpoint the killed run had committed
    # Lines in words: gloo's start-up lines aside, and bare numbers that native code writes
    # unflushed now and then (one CI run saw a lone "7"); every jaxrl message has words.
    for other in others:
        said = [line for line in other.splitlines()
                if any(c.isalpha() for c in line) and "peer ranks" not in line]
        assert "jaxrl train" in leader and said == [], said      # only process 0 speaks
    # Resumed from the newest checkpoint the killed run left: every step written once, by
    # process 0 (the killed run's rows past that checkpoint dropped), every sample trained once.
    rows = [r for r in read_metrics(rl_run["run_dir"]) if "reward" in r]
    assert [r["step"] for r in rows] == list(range(STEPS + 1, RL_END + 1))
    assert [r["samples_trained"] for r in rows] == [16 * k for k in range(1, len(rows) + 1)]
    assert all(np.isfinite(r["loss"]) for r in rows), rows
    # The server left served the resumed run's weights, gathered from the four processes and
    # pulled device to device.
    assert rl_run["served"]["version"] >= RL_END - 1, rl_run["served"]
    assert rows[-1]["pushes"] >= 2, rows[-1]
    # All four processes wrote the checkpoints; process 0 wrote the rollout stream's state.
    from jaxrl.train.checkpoint import Checkpointer
    ckpt = Checkpointer(rl_run["run_dir"] / "checkpoints")
    assert ckpt.all_steps()[-1] == RL_END
    assert ckpt.saved_data(RL_END)["trained"] == (RL_END - STEPS) * 16
    ckpt.close()


def test_process_zero_failing_stops_the_others(tmp_path, runs):
    """No server answers: process 0 gives up after rl.generation.wait_s; process 1, waiting for
    a batch, stops with it (one line, no traceback) instead of waiting forever."""
    run_dir = tmp_path / "run"
    shutil.copytree(runs["four"] / "checkpoints", run_dir / "checkpoints")
    leader, other = (finish(p, returncode=2) for p in processes(
        run_dir, 2, *RL, f"rl.generation.servers=127.0.0.1:{free_port()}",
        "rl.generation.wait_s=3"))
    assert "does not answer yet" in leader, leader[-3000:]
    assert "jaxrl train: error: no generation member could take work" in leader, leader[-3000:]
    assert "process 0 stopped the run" in other and "Traceback" not in other, other[-3000:]
