"""The Colab notebooks, executed headless as a user runs them (short mode: a few steps each).

A cell that raises fails the test. The kernel runs on one CPU device, as on Colab's CPU runtime
(the library's meshes are tested elsewhere); its working directory and run folder are
temporary, so nothing is written into the repository."""

import json
import re
import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient
from tests.xla import xla_flags

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # each runs a notebook end to end

ONE_DEVICE = xla_flags(1)  # one device, as on Colab's CPU runtime


def execute(name: str, cwd: Path, run_dir: Path, monkeypatch):
    """Runs colab/<name> in a fresh kernel; returns the executed notebook."""
    nb = nbformat.read(ROOT / "colab" / name, as_version=4)
    assert all(not c.outputs and c.execution_count is None
               for c in nb.cells if c.cell_type == "code"), \
        f"{name} is stored with outputs: clear them before saving"
    monkeypatch.setenv("JAXRL_NOTEBOOK_SHORT", "1")
    monkeypatch.setenv("JAXRL_NOTEBOOK_RUN_DIR", str(run_dir))
    monkeypatch.setenv("XLA_FLAGS", ONE_DEVICE)
    monkeypatch.delenv("JAXRL_NOTEBOOK_CHECKPOINT", raising=False)
    # jupyter_client runs "python" as this interpreter; another one would not find jaxrl.
    kernel = KernelSpecManager().get_kernel_spec("python3").argv[0]
    assert kernel in ("python", sys.executable), f"the python3 kernel runs {kernel}"
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(cwd)}}).execute()
    return nb


def text_of(nb) -> str:
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.outputs if o.output_type == "stream")


def images_of(nb) -> int:
    return sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code"
               for o in c.outputs)


def rl_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "lag_mean" in r]


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory):
    """The quickstart, run once; restore_and_eval then runs on its folder."""
    tmp = tmp_path_factory.mktemp("quickstart")
    with pytest.MonkeyPatch.context() as mp:
        nb = execute("quickstart.ipynb", tmp, tmp / "run", mp)
    return nb, tmp / "run"


def test_quickstart_trains_both_modes_and_plots(quickstart_run):
    nb, run_dir = quickstart_run
    assert (run_dir / "warmup" / "checkpoints" / "4").is_dir()
    lags = {}
    for mode in ("async", "sync"):
        rows = rl_rows(run_dir / mode)
        assert [r["step"] for r in rows] == [5, 6, 7], mode
        assert all(r["samples_per_s"] > 0 and "reward" in r for r in rows)
        assert sorted(int(p.name) for p in (run_dir / mode / "checkpoints").iterdir()) == [4, 7]
        lags[mode] = sum(r["lag_mean"] for r in rows)
    # Async trains on samples of older weights while the engine keeps going; sync waits.
    assert lags["async"] > lags["sync"]
    text = text_of(nb)
    for mode in ("async", " sync"):
        assert re.search(rf"{mode}: 3 steps, the last 2 in .* held-out accuracy "
                         rf"\d+\.\d% -> \d+\.\d%", text), mode
    # reward of async; the lag histogram; reward and lag of both modes
    assert images_of(nb) == 4
    assert (run_dir / "async_vs_sync_reward.png").stat().st_size > 0


def _check_export(nb, run_dir: Path) -> None:
    text = text_of(nb)
    export = run_dir / "hf_export"
    assert {"config.json", "model.safetensors"} <= {p.name for p in export.iterdir()}
    assert json.loads((export / "config.json").read_text())["model_type"] == "llama"
    for reader, tol in (("from_hf", 1e-5), ("transformers", 1e-4)):
        found = re.search(rf"{reader} logits: max \|diff\| = (\S+)", text)
        assert found, f"no {reader} comparison in the output"
        assert float(found.group(1)) <= tol
    assert "orbax alone restores the same parameters: True" in text
    assert re.search(r"same as greedy decoding without a cache: \d/4", text)
    assert re.search(r"held-out accuracy \d+\.\d% on 16 problems", text)


def test_restore_and_eval_uses_the_quickstart_checkpoint(quickstart_run, monkeypatch, tmp_path):
    _, run_dir = quickstart_run
    nb = execute("restore_and_eval.ipynb", tmp_path, run_dir, monkeypatch)
    text = text_of(nb)
    assert "no checkpoint yet" not in text
    assert f"checkpoint: {run_dir / 'async' / 'checkpoints'}" in text
    assert "step 7: llama" in text
    _check_export(nb, run_dir)


def test_restore_and_eval_alone_trains_its_own_checkpoint(monkeypatch, tmp_path):
    run_dir = tmp_path / "run"
    nb = execute("restore_and_eval.ipynb", tmp_path, run_dir, monkeypatch)
    text = text_of(nb)
    assert "no checkpoint yet" in text
    assert (run_dir / "warmup" / "checkpoints" / "4").is_dir()
    assert "step 4: llama" in text
    _check_export(nb, run_dir)


def test_rl_with_lora_trains_adapters_and_exports_them_for_peft(monkeypatch, tmp_path):
    run_dir = tmp_path / "run"
    nb = execute("rl_with_lora.ipynb", tmp_path, run_dir, monkeypatch)
    text = text_of(nb)
    assert "cpu: 1 cpu device(s)" in text
    assert [r["step"] for r in rl_rows(run_dir / "run")] == [1, 2]
    assert ("{'peft_type': 'LORA', 'r': 16, 'lora_alpha': 32.0, 'target_modules': ['q_proj', "
            "'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj']}") in text
    assert "['adapter_config.json', 'adapter_model.safetensors']" in text
    config = json.loads((run_dir / "export" / "base" / "config.json").read_text())
    assert config["model_type"] == "qwen2"


def test_tinker_trains_through_the_sdk_against_a_service_in_the_kernel(monkeypatch, tmp_path):
    """colab/tinker.ipynb: `jaxrl tinker` started in the notebook's own runtime, the official
    SDK's supervised loop lowers the loss, its RL loop runs, the state is saved as an Orbax
    checkpoint, and the service stops."""
    run_dir = tmp_path / "run"
    text = text_of(execute("tinker.ipynb", tmp_path, run_dir, monkeypatch))
    losses = [float(x) for x in re.findall(r"sft step \d+: loss per answer token ([\d.]+)", text)]
    assert len(losses) == 6 and losses[-1] < losses[0], text
    assert len(re.findall(r"rl step \d+: mean reward [\d.]+", text)) == 2, text
    assert "saved tinker://" in text and "service stopped" in text
    assert list((run_dir / "state").glob("*/weights/colab/state"))
