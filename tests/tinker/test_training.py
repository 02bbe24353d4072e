"""The Tinker trainer's programs in-process: clients batched into one vmapped program equal each
run alone, and the built-in losses equal their documented formulas computed here in numpy from
the log-probabilities the program returns."""

import numpy as np
import pytest

from jaxrl.models import Transformer
from jaxrl.models.config import ModelConfig
from jaxrl.tinker import losses
from jaxrl.tinker.training import Trainer, check_adam, lora_config
from jaxrl.tinker.wire import Datum


@pytest.fixture(scope="module")
def trainer():
    from flax import nnx

    cfg = ModelConfig(vocab_size=48, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, mlp_dim=64, max_seq_len=64)
    return Trainer(Transformer(cfg, rngs=nnx.Rngs(0)), 64)


def _datum(rng, n, loss_fn):
    ids = rng.integers(0, 48, n + 1)
    inputs = {"target_tokens": ids[1:]}
    if loss_fn == "cross_entropy":
        inputs["weights"] = rng.uniform(0, 1, n).astype(np.float32)
    else:
        inputs["logprobs"] = rng.uniform(-5, -1, n).astype(np.float32)
        inputs["advantages"] = rng.normal(size=n).astype(np.float32)
    return Datum(ids[:-1].astype(np.int32), inputs)


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "ppo", "cispo"])
def test_clients_batched_equal_each_alone_and_the_formula(trainer, loss_fn):
    rng = np.random.default_rng(0)
    data = [[_datum(rng, n, loss_fn) for n in sizes] for sizes in ((5, 9), (17,), (3, 4, 6))]
    configs = [{}, {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5} if
               loss_fn != "cross_entropy" else {}, {}]
    lo = lora_config(4, True, True)

    def clients():
        cs = [trainer.new_client(f"c{i}", "m", lo, i) for i in range(3)]
        warm = np.random.default_rng(1)
        for c in cs:       # B away from zero, so each client's model differs
            warm_up = [[_datum(warm, 8, "cross_entropy")]]
            trainer.forward_backward([c], "cross_entropy", [{}], warm_up, True)
            trainer.optim_step(c, check_adam({"learning_rate": 0.05}))
        return cs

    together = trainer.forward_backward(clients(), loss_fn, configs, data, True)
    alone = [trainer.forward_backward([c], loss_fn, [cfg], [d], True)[0]
             for c, cfg, d in zip(clients(), configs, data)]
    for (outs, metrics), (outs1, metrics1), ds, cfg in zip(together, alone, data, configs):
        assert metrics["loss:sum"] == pytest.approx(metrics1["loss:sum"], rel=1e-5)
        for o, o1, d in zip(outs, outs1, ds):
            np.testing.assert_allclose(o["logprobs"], o1["logprobs"], atol=1e-5)
            lo_, hi = losses.thresholds(losses.LOSSES[loss_fn], cfg)
            lp, x = o["logprobs"].astype(np.float64), d.inputs
            if loss_fn == "cross_entropy":
                want = -x["weights"] * lp
            else:
                r, a = np.exp(lp - x["logprobs"]), x["advantages"]
                want = (-np.minimum(r * a, np.clip(r, lo_, hi) * a) if loss_fn == "ppo"
                        else -np.clip(r, lo_, hi) * lp * a)
            np.testing.assert_allclose(o["elementwise_loss"], want, rtol=1e-4, atol=1e-5)
        assert metrics["loss:sum"] == pytest.approx(
            sum(o["elementwise_loss"].sum() for o in outs), rel=1e-5)
