"""configs/tool_calc_cpu.yaml end to end, scaled down: `jaxrl train` in a process on one CPU
device, as a user runs it (a supervised warm-up on worked calculator episodes, then async RL on
the model's own multi-turn episodes); and the bad multi-turn settings refused by name."""

import json

import pytest

from jaxrl.config import ConfigError, load_run_config
from tests.run import one_device

pytestmark = pytest.mark.slow

# A 0.1M-parameter model, 60 warm-up steps (enough to learn the call format, not the sums;
# without the config's accuracy checks, whose engine would add its own compilation), 3 RL
# steps. Zero-advantage groups are kept, so steps are fed whatever the model solves.
SMALL = ["model.num_layers=2", "model.embed_dim=64", "model.mlp_dim=192",
         "model.head_dim=16", "train.steps=60", "train.batch_size=32", "train.log_every=20",
         "train.eval_problems=8", "train.stop_at_accuracy=0", "checkpoint.every=1000",
         "log.progress=false", "rl.steps=3", "rl.prompts_per_step=4", "rl.group_size=4",
         "rl.engine.max_concurrent_decodes=16", "rl.microbatch_rows=8",
         "rl.filter_zero_advantage=false",
         "rl.filter_overlong=false",
         "rl.eval_every=0"]


def test_multi_turn_config_trains_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    one_device.train("configs/tool_calc_cpu.yaml", SMALL, run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r.get("phase") == "rl" and "loss" in r]
    assert [r["step"] for r in rl] == [61, 62, 63]
    assert all(r["trained_tokens"] > 0 for r in rl)
    finished = [r for r in rl if r["episodes"]]     # async: a step may see none finish
    assert sum(r["episodes"] for r in rl) >= 3 * 16
    for r in finished:
        assert 1 <= r["turns_per_episode"] <= 4 and 0 <= r["tool_error_rate"] <= 1
    assert any(r["env_tokens_per_model_token"] > 0 for r in finished)   # tools were called
    evals = [r["eval_accuracy"] for r in rows if "eval_accuracy" in r]
    assert len(evals) >= 2 and all(0 <= a <= 1 for a in evals)


@pytest.mark.parametrize("overrides, message", [
    (["rl.max_turns=0"], r"rl.max_turns=0 must be >= 1"),
    (["rl.max_episode_tokens=5"], r"rl.max_episode_tokens=5 is below one turn's "
                                  r"rl.max_new_tokens=10"),
    (["rl.pack_len=40"], r"rl.pack_len=40 cannot hold one sample of rl.max_prompt_len \+ "
                         r"rl.max_episode_tokens = 54 tokens"),
])
def test_bad_multi_turn_settings_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config("configs/tool_calc_cpu.yaml", overrides)
