"""`jaxrl train` as two processes on jax.distributed (127.0.0.1, gloo collectives, 4 CPU devices
each: one global fsdp=4 x tensor=2 mesh) against one process with 8 devices: the same warm-up,
step by step (loss and gradient norm, relative 1e-5) and in its final parameters; each process
built only its own rows of every batch; the checkpoint the two wrote together restores in one
process with plain Orbax."""

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from jaxrl.run.metrics import read_metrics

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6
ARGS = ["--config", str(ROOT / "configs/demo_cpu.yaml"), "model.embed_dim=32",
        "model.num_layers=2", "model.mlp_dim=64", f"train.steps={STEPS}",
        "train.batch_size=16", "train.microbatches=2", "train.log_every=1",
        "train.eval_problems=0", "checkpoint.every=3", "rl.steps=0", "log.progress=false",
        "mesh.fsdp=4", "mesh.tensor=2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(run_dir: Path, devices: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    return subprocess.Popen([sys.executable, "-m", "jaxrl.cli", "train", *ARGS,
                             f"run_dir={run_dir}", *extra], cwd=run_dir.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    one = tmp_path_factory.mktemp("one") / "run"
    two = tmp_path_factory.mktemp("two") / "run"
    port = free_port()
    procs = [train(two, 4, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                   "--process-id", str(i)) for i in range(2)]
    outputs = [finish(p) for p in procs]
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
    assert "mesh {'data': 1, 'stage': 1, 'fsdp': 4, 'tensor': 2}" in leader
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
