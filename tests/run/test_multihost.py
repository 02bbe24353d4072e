"""`jaxrl train` as two processes on jax.distributed (127.0.0.1, gloo collectives, 4 CPU devices
each: one global fsdp=4 x tensor=2 mesh) against one process with 8 devices: the same warm-up,
step by step (loss and gradient norm, relative 1e-5) and in its final parameters; each process
built only its own rows of every batch; the checkpoint the two wrote together restores in one
process with plain Orbax.

Then RL on from that checkpoint, still in two processes, generating on a `jaxrl serve`
subprocess that pulls each version's weights from process 0 over jax.experimental.transfer:
process 0 leads (actor, pushes, metrics), process 1 trains beside it; and a process
0 that cannot reach its fleet stops process 1 with it instead of leaving it waiting."""

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
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


RL = ["rl.steps=4", "rl.prompts_per_step=4", "rl.group_size=4", "rl.slots=16",
      "rl.microbatch_rows=8", "checkpoint.resume=true", "rl.generation.heartbeat_s=0.5"]
# The RL run sends its weights device to device (serving/transfer.py), the fleet test streams.
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


def two_processes(run_dir: Path, *extra: str) -> list[subprocess.Popen]:
    port = free_port()
    return [train(run_dir, 4, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                  "--process-id", str(i), *extra) for i in range(2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    one = tmp_path_factory.mktemp("one") / "run"
    two = tmp_path_factory.mktemp("two") / "run"
    outputs = [finish(p) for p in two_processes(two)]
    single = finish(train(one, 8))
    return {"one": one, "two": two, "outputs": outputs, "single": single}


def test_two_processes_train_as_one_process_does(runs):
    want, got = read_metrics(runs["one"]), read_metrics(runs["two"])
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm", "token_accuracy", "tokens"):
        np.testing.assert_allclose([r[key] for r in got], [r[key] for r in want], rtol=1e-5,
                                   err_msg=key)


def test_process_zero_speaks_for_both(runs):
    leader, other = runs["outputs"]
    assert ("mesh {'data': 1, 'stage': 1, 'fsdp': 4, 'expert': 1, 'context': 1, "
            "'tensor': 2}") in leader
    assert "jaxrl train" in leader and "jaxrl train" not in other      # the summary table
    assert "  loss " in leader and "  loss " not in other              # the step lines


def test_the_two_process_checkpoint_restores_in_one_process_with_plain_orbax(runs):
    """Both final checkpoints restored by plain Orbax in a process without jaxrl: the same
    parameters (relative 1e-5), and the same steps kept."""
    script = textwrap.dedent("""
        import json, sys
        import jax
        import numpy as np
        import orbax.checkpoint as ocp
        out = {}
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        for name in ("one", "two"):
            manager = ocp.CheckpointManager(sys.argv[1 if name == "one" else 2])
            step = manager.latest_step()
            # Saved on 8 devices of 2 processes: restored onto this process's one device,
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
                          str(runs["two"] / "checkpoints")], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    restored = json.loads(out.stdout.strip().splitlines()[-1])
    assert restored["one"]["steps"] == restored["two"]["steps"] == [3, 6]
    one, two = restored["one"]["leaves"], restored["two"]["leaves"]
    assert sorted(one) == sorted(two)
    for name in one:
        np.testing.assert_allclose(np.asarray(two[name]), np.asarray(one[name]), rtol=1e-5,
                                   atol=1e-7, err_msg=name)


@pytest.fixture(scope="module")
def rl_run(runs, tmp_path_factory):
    """RL steps 7..10 from the two-process warm-up's checkpoint, in two processes again, with
    one `jaxrl serve` (serving that checkpoint, restored in its one process) generating."""
    run_dir = tmp_path_factory.mktemp("two_rl") / "run"
    shutil.copytree(runs["two"] / "checkpoints", run_dir / "checkpoints")
    token = run_dir / "token"
    token.write_text("multihost-token")
    server = subprocess.Popen(
        [sys.executable, "-m", "jaxrl.cli", "serve", "--checkpoint", str(run_dir / "checkpoints"),
         "--port", "0", "--slots", "16", "--max-len", "15", "--max-prefill-length", "8",
         "--prefill-chunk", "8", "--page-size", "4", "--update-token-file", str(token)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""})
    try:
        address = _ready(server)
        outputs = [finish(p) for p in two_processes(
            run_dir, *RL, *RL_TRANSFER, f"rl.generation.servers={address}",
            f"rl.generation.token_file={token}")]
        from serving.client import RemoteGeneration
        remote = RemoteGeneration(address, rpc_timeout_s=30)
        served = remote.metrics()
        remote.close()
    finally:
        server.kill()
        server.wait(60)
    return {"run_dir": run_dir, "outputs": outputs, "served": served}


def _ready(server: subprocess.Popen) -> str:
    output = []
    for line in server.stdout:
        output.append(line)
        if "ready on" in line:
            import threading
            threading.Thread(target=server.stdout.read, daemon=True).start()   # keep it drained
            return line.split("ready on ")[1].split(": ")[0]
    raise AssertionError("jaxrl serve did not start:\n" + "".join(output)[-3000:])


def test_rl_in_two_processes_with_a_generation_server(rl_run):
    leader, other = rl_run["outputs"]
    assert "trainer on 8 device(s) in 2 processes" in leader, leader[-3000:]
    # Lines in words: gloo's start-up lines aside, and bare numbers that native code writes
    # unflushed now and then (one CI run saw a lone "7"); every jaxrl message has words.
    said = [line for line in other.splitlines()
            if any(c.isalpha() for c in line) and "peer ranks" not in line]
    assert "jaxrl train" in leader and said == [], said      # process 1 says nothing
    rows = [r for r in read_metrics(rl_run["run_dir"]) if "reward" in r]
    assert [r["step"] for r in rows] == [7, 8, 9, 10]        # written once, by process 0
    assert [r["samples_trained"] for r in rows] == [16, 32, 48, 64]
    assert all(np.isfinite(r["loss"]) for r in rows), rows
    # Weights gathered from both processes reached the server, pulled device to device (its
    # first were step 6's); no pull failed.
    assert rl_run["served"]["version"] >= 7, rl_run["served"]
    assert rows[-1]["pushes"] >= 2 and rows[-1]["push_failures"] == 0, rows[-1]
    # Both processes wrote the checkpoints; process 0 wrote the rollout stream's state.
    from jaxrl.train.checkpoint import Checkpointer
    ckpt = Checkpointer(rl_run["run_dir"] / "checkpoints")
    assert ckpt.all_steps()[-2:] == [9, 10]
    assert ckpt.saved_data(10)["trained"] == 4 * 16
    ckpt.close()


def test_process_zero_failing_stops_the_others(tmp_path, runs):
    """No server answers: process 0 gives up after rl.generation.wait_s; process 1, waiting for
    a batch, stops with it (one line, no traceback) instead of waiting forever."""
    run_dir = tmp_path / "run"
    shutil.copytree(runs["two"] / "checkpoints", run_dir / "checkpoints")
    leader, other = (finish(p, returncode=2) for p in two_processes(
        run_dir, *RL, f"rl.generation.servers=127.0.0.1:{free_port()}",
        "rl.generation.wait_s=3"))
    assert "does not answer yet" in leader, leader[-3000:]
    assert "jaxrl train: error: no generation member could take work" in leader, leader[-3000:]
    assert "process 0 stopped the run" in other and "Traceback" not in other, other[-3000:]
