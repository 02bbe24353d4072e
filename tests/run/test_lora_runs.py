"""LoRA through the whole run (`jaxrl train`'s path) from a tiny random Qwen2 folder: RL trains
the adapters alone (the checkpoint's base weights are the folder's, bit for bit), and
`jaxrl export` writes the result as a merged Hugging Face folder and as a base plus PEFT
adapter folder that `peft` loads onto `transformers`, both with the checkpoint's logits."""

import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
import transformers

from jaxrl import cli
from jaxrl.commands import job
from jaxrl.config import load_run_config
from jaxrl.models import from_hf, lora, quant
from jaxrl.models.transformer import split_params
from jaxrl.telemetry.metrics import read_metrics
from jaxrl.trainer.warmup import restore_for_eval
from tests.tiny_hf import tiny_qwen

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_reward"
RUN = ["model.dtype=float32", "log.progress=false", "train.eval_problems=0", "rl.steps=3",
       "rl.mode=sync", "rl.prompts_per_step=2", "rl.group_size=4",
       "rl.engine.max_concurrent_decodes=8",
       "rl.max_new_tokens=6", "rl.pack_len=96", "rl.microbatch_rows=8",
       "rl.filter_zero_advantage=false", "rl.filter_overlong=false", "rl.optim.lr=0.05",
       "task.reward=[examples/custom_reward/rewards.py:short]", "task.reward_weights=[1.0]",
       "model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=q_proj,v_proj,down_proj"]


def _peft():
    """The peft package, imported by the tests that use it: its import takes 3-4 s, which every
    pytest worker would otherwise spend collecting this file."""
    import peft
    return peft


def _train(tmp, run_dir, *overrides):
    cfg = load_run_config(EXAMPLE / "config.yaml",
                          [f"hf_path={tmp / 'qwen'}", f"run_dir={run_dir}",
                           *(o for o in RUN if o.split("=")[0] not in
                             {x.split("=")[0] for x in overrides}), *overrides])
    cwd, lines = os.getcwd(), []
    os.chdir(EXAMPLE.parents[1])        # the config names its rewards from the repository
    try:
        job.run(cfg, log=lines.append)
    finally:
        os.chdir(cwd)
    return lines


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    rows = [json.loads(line) for line in (EXAMPLE / "prompts.jsonl").read_text().splitlines()]
    (tmp / "qwen").mkdir()
    tiny_qwen(tmp / "qwen", [m["content"] + " " + r["word"][::-1] for r in rows
                             for m in r["prompt"]] + ["user assistant"])
    _train(tmp, tmp / "run")
    return tmp


def test_the_engine_samples_from_the_trainers_adapters(run):
    """After its first push (every weight, step 1's) the engine gets the adapters alone, the
    base staying on it: the log-probs it reports for step 3's samples, made by the weights of
    step 2, are the trainer's own for the same tokens."""
    rows = {r["step"]: r for r in read_metrics(run / "run") if "logprob_parity_tokens" in r}
    for step in (2, 3):
        assert rows[step]["logprob_parity_tokens"] > 0
        assert rows[step]["logprob_abs_diff_max"] < 1e-4, step


def test_rl_trains_the_adapters_alone(run):
    model, _, _, step, _ = restore_for_eval(run / "run" / "checkpoints", with_config=True)
    assert step == 3 and model.cfg.lora.rank == 4
    _, params = split_params(model)
    _, base = split_params(from_hf(run / "qwen", "float32"))
    for name, value in lora.frozen(params)["layers"].items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(base["layers"][name]))
    np.testing.assert_array_equal(np.asarray(params["embed"]), np.asarray(base["embed"]))
    adapters = lora.trainable(params)["layers"]
    assert sorted(adapters) == sorted(f"{t}_lora_{m}" for t in ("q_proj", "v_proj", "down_proj")
                                      for m in "ab")
    assert all(np.abs(np.asarray(adapters[f"{t}_lora_b"])).max() > 0
               for t in ("q_proj", "v_proj", "down_proj"))


def test_a_resumed_lora_run_ends_exactly_where_the_straight_run_does(run):
    """Stopped after step 2 and resumed, the run's step 3 is the straight run's to the bit:
    the checkpoint holds the adapters, their optimizer state and the rollout stream."""
    _train(run, run / "resumed", "rl.steps=2")
    lines = _train(run, run / "resumed")
    assert any(f"resumed RL from {run / 'resumed' / 'checkpoints'}/2" in x for x in lines), lines
    got = split_params(restore_for_eval(run / "resumed" / "checkpoints")[0])[1]
    want = split_params(restore_for_eval(run / "run" / "checkpoints")[0])[1]
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))
    assert np.abs(np.asarray(got["layers"]["q_proj_lora_b"])).max() > 0


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.from_numpy(ids).long()).logits.numpy()


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()


def test_export_merged_and_peft_give_the_checkpoints_logits(run, tmp_path):
    model, _, _, _ = restore_for_eval(run / "run" / "checkpoints")
    ids = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (2, 10)).astype(np.int32)
    want = np.asarray(model(ids))
    ckpt = str(run / "run" / "checkpoints")
    assert cli.main(["export", "--checkpoint", ckpt, "--out", str(tmp_path / "m")]) == 0
    np.testing.assert_allclose(_logits(_hf(tmp_path / "m"), ids), want, rtol=1e-5, atol=1e-5)
    assert cli.main(["export", "--checkpoint", ckpt, "--out", str(tmp_path / "p"),
                     "--format", "peft"]) == 0
    config = json.loads((tmp_path / "p" / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(run / "qwen")
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    adapted = _peft().PeftModel.from_pretrained(_hf(tmp_path / "p" / "base"),
                                             tmp_path / "p" / "adapter")
    np.testing.assert_allclose(_logits(adapted, ids), want, rtol=1e-5, atol=1e-5)


def test_an_int8_base_trains_its_adapters_serves_them_and_exports(run, tmp_path):
    """model.quantize=int8 from the folder: the checkpoint holds the folder's projections as
    int8 (quantized from them, untouched by RL), the engine samples from them with the
    trainer's log-probs, and both exports give the checkpoint's logits on transformers (the
    base folder is the dequantized int8 base, and the adapter names it)."""
    _train(run, tmp_path / "run", "model.quantize=int8")
    rows = [r for r in read_metrics(tmp_path / "run") if "logprob_parity_tokens" in r]
    assert all(r["logprob_abs_diff_max"] < 1e-4 for r in rows[1:]) and len(rows) == 3
    model, _, _, _ = restore_for_eval(tmp_path / "run" / "checkpoints")
    _, params = split_params(model)
    _, folder = split_params(from_hf(run / "qwen", "float32"))
    want_q, want_scale = quant.quantize(folder["layers"]["k_proj"], "k_proj")
    np.testing.assert_array_equal(np.asarray(params["layers"]["k_proj"]), np.asarray(want_q))
    np.testing.assert_array_equal(np.asarray(params["layers"]["k_proj_scale"]),
                                  np.asarray(want_scale))
    ids = np.random.default_rng(1).integers(0, model.cfg.vocab_size, (2, 10)).astype(np.int32)
    want = np.asarray(model(ids))
    ckpt = str(tmp_path / "run" / "checkpoints")
    assert cli.main(["export", "--checkpoint", ckpt, "--out", str(tmp_path / "m")]) == 0
    np.testing.assert_allclose(_logits(_hf(tmp_path / "m"), ids), want, rtol=1e-5, atol=1e-5)
    assert cli.main(["export", "--checkpoint", ckpt, "--out", str(tmp_path / "p"),
                     "--format", "peft"]) == 0
    config = json.loads((tmp_path / "p" / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "p" / "base").resolve())
    adapted = _peft().PeftModel.from_pretrained(_hf(tmp_path / "p" / "base"),
                                             tmp_path / "p" / "adapter")
    np.testing.assert_allclose(_logits(adapted, ids), want, rtol=1e-5, atol=1e-5)
