"""RL on the other model families through `jaxrl train`'s path: a tiny model of each is warmed up
from scratch on the arithmetic task, then trained by sync RL. The engine samples through its
paged cache and the trainer recomputes every token's log-prob over packed rows: the two must
agree as they do for Llama (tests/run/test_rl.py).
- gemma2: sandwich norms, GeGLU, both soft-caps, a sliding layer whose window is shorter than
  every sample, then a full one;
- qwen3_moe: 4 experts, each token routed to 2; the engine records its routing and the
  trainer replays it (rl.moe_routing=replay), logging every step how often its own routers
  would have chosen differently (in float32, on these weights: never); the warm-up and RL
  train with the load-balancing loss."""

import pytest

from jaxrl.commands import job
from jaxrl.telemetry.metrics import read_metrics
from tests.run.test_rl import BASE, config, quiet

pytestmark = pytest.mark.slow

WARMUP, RL_STEPS = 10, 3
FAMILIES = {
    "gemma2": ["model.family=gemma2", "model.sliding_window=3",
               "model.layer_types=[sliding, full]", "model.query_pre_attn_scalar=12",
               "model.attn_softcap=4.0", "model.final_softcap=8.0"],
    "qwen3_moe": ["model.family=qwen3_moe", "model.qk_norm=true", "model.num_experts=4",
                  "model.experts_per_token=2", "model.moe_mlp_dim=48",
                  "rl.moe_routing=replay", "model.router_aux_loss_coef=0.01"],
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sync_rl_trains_on_the_engine_s_log_probs(family, tmp_path):
    assert "model.num_layers=2" in BASE
    cfg = config(tmp_path / "run", *FAMILIES[family], f"train.steps={WARMUP}",
                 f"rl.steps={RL_STEPS}", "rl.mode=sync", "rl.prompts_per_step=4")
    assert cfg.model.family == family
    job.run(cfg, log=quiet)
    rows = [r for r in read_metrics(tmp_path / "run") if "reward" in r]
    assert [r["step"] for r in rows] == list(range(WARMUP + 1, WARMUP + RL_STEPS + 1))
    # Every sample (a prompt such as "4+3=", its answer, EOS) is longer than the window.
    assert all(r["trained_tokens"] > 0 for r in rows)
    assert sum(r["logprob_parity_tokens"] for r in rows) >= 0.9 * sum(
        r["trained_tokens"] for r in rows)
    assert max(r["logprob_abs_diff_max"] for r in rows) <= 5e-5
    if family == "qwen3_moe":
        assert all(r["router_mismatch"] == 0 and r["router_choice_mismatch"] == 0
                   for r in rows)
        # The load-balancing loss (tests/models/test_hf.py checks its value): at most E = 4.
        assert all(0 < r["router_aux_loss"] <= 4 for r in rows)
