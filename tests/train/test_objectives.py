"""Token log-probs, entropy, losses and gradients computed in chunks of positions equal the same
computed from the whole [B, T, V] logits block at once."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models import ModelConfig, Transformer, merge_params, split_params
from jaxrl.train.objectives import PolicyGradientLoss, SupervisedLoss, token_logp
from serving.runner.engine_config import EngineConfig

CFG = ModelConfig(vocab_size=48, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, mlp_dim=64, tie_embeddings=True)
B, T = 3, 11


@pytest.fixture(scope="module")
def model():
    return Transformer(CFG, rngs=nnx.Rngs(3))


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, CFG.vocab_size, size=(B, T + 1)).astype(np.int32)
    mask = (rng.random((B, T)) < 0.7).astype(np.float32)
    return {"input_ids": ids[:, :-1], "targets": ids[:, 1:], "loss_mask": mask,
            "behaviour_logp": rng.normal(-3.0, 0.3, (B, T)).astype(np.float32),
            "advantages": rng.normal(0, 1, (B, T)).astype(np.float32),
            "segment_ids": np.ones((B, T), np.int32),
            "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))}


def _reference(model, mb, temperature):
    """The whole logits block at once, by the textbook formulas."""
    logp_BTV = jax.nn.log_softmax(model(mb["input_ids"]) / temperature, axis=-1)
    logp_BT = jnp.take_along_axis(logp_BTV, mb["targets"][..., None], axis=-1)[..., 0]
    entropy_BT = -jnp.sum(jnp.exp(logp_BTV) * logp_BTV, axis=-1)
    return logp_BT, entropy_BT, jnp.argmax(logp_BTV, axis=-1) == mb["targets"]


@pytest.mark.parametrize("chunk", [1, 4, 64])   # 4 leaves a ragged last chunk; 64 > T
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_token_stats_equal_the_whole_block(model, chunk, temperature):
    mb = _batch()
    got = token_logp(model, mb, temperature, chunk=chunk)
    for a, b in zip(got[:2], _reference(model, mb, temperature)[:2]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[2], _reference(model, mb, temperature)[2])


@pytest.mark.parametrize("objective", [SupervisedLoss(), PolicyGradientLoss(kind="ppo"),
                                       PolicyGradientLoss(kind="tis", temperature=0.7)],
                         ids=["sft", "ppo", "tis"])
def test_chunked_loss_and_gradients_equal_unchunked(model, objective):
    graphdef, params = split_params(model)
    mb = _batch(1)

    def loss(params, chunk):
        obj = type(objective)(**{**objective.__dict__, "logits_chunk": chunk})
        loss_sum, weight, _ = obj(merge_params(graphdef, params), mb)
        return loss_sum / weight

    grads = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    whole, g_whole = grads(params, 0)
    chunked, g_chunked = grads(params, 4)
    np.testing.assert_allclose(chunked, whole, rtol=1e-5, atol=1e-7)   # float32 rounding
    for a, b in zip(jax.tree.leaves(g_chunked), jax.tree.leaves(g_whole)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(jnp.abs(b).max()))


def test_logprob_parity_counts_only_lag_zero_tokens():
    """The sampler/trainer gap against numpy: mean and largest |trainer - sampler| and the k3
    KL estimate over the tokens marked on-policy; none marked gives NaN (logged as null)."""
    from jaxrl.train.objectives import logprob_parity, summarize_parity

    rng = np.random.default_rng(3)
    trainer = rng.normal(-2, 0.5, (3, 7)).astype(np.float32)
    sampler = (trainer + rng.normal(0, 1e-3, (3, 7))).astype(np.float32)
    on = (rng.random((3, 7)) < 0.5).astype(np.float32)
    on[0, 0], on[1, 1] = 1.0, 0.0
    sampler[1, 1] = trainer[1, 1] + 5.0          # a large gap on a token that is not lag 0
    got = {k: float(v) for k, v in summarize_parity(
        logprob_parity(jnp.asarray(trainer), jnp.asarray(sampler), jnp.asarray(on))).items()}
    d = (trainer - sampler)[on > 0].astype(np.float64)
    assert got["logprob_parity_tokens"] == on.sum()
    np.testing.assert_allclose(got["logprob_diff_mean"], d.mean(), rtol=1e-4, atol=1e-8)
    np.testing.assert_allclose(got["logprob_abs_diff_max"], np.abs(d).max(), rtol=1e-5)
    np.testing.assert_allclose(got["logprob_kl"], np.mean(np.expm1(d) - d), rtol=1e-2,
                               atol=1e-10)
    none = summarize_parity(logprob_parity(jnp.asarray(trainer), jnp.asarray(sampler),
                                           jnp.zeros((3, 7))))
    assert np.isnan(float(none["logprob_diff_mean"])) and float(none["logprob_parity_tokens"]) == 0


@pytest.mark.parametrize("kind", ["tis", "ppo"])
def test_trainer_behaviour_logprobs_replace_the_engines_on_lag_zero_tokens(model, kind):
    """rl.behaviour_logprobs=trainer: on lag-0 tokens mu is the trainer's own log-prob (ratio 1,
    whatever the engine reported); the other tokens keep the engine's. The loss and gradients
    equal the engine setting given the trainer's log-probs as the engine's on those tokens."""
    graphdef, params = split_params(model)
    mb = _batch(2)
    on = (np.random.default_rng(5).random((B, T)) < 0.5) & (mb["loss_mask"] > 0)
    mb["on_policy"] = on.astype(np.float32)
    logp = np.asarray(token_logp(model, mb, 1.0)[0])
    faithful = {**mb, "behaviour_logp": np.where(on, logp, mb["behaviour_logp"])}

    def loss(params, batch, behaviour):
        obj = PolicyGradientLoss(kind=kind, behaviour=behaviour)
        loss_sum, weight, stats = obj(merge_params(graphdef, params), batch)
        return loss_sum / weight, stats

    grads = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=2)
    (got, stats), g_got = grads(params, mb, "trainer")
    (want, _), g_want = grads(params, faithful, "engine")
    (engine, _), _ = grads(params, mb, "engine")
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert abs(float(engine) - float(got)) > 1e-3      # the engine's mu did matter
    for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * float(jnp.abs(b).max()))
    # The parity metric still compares against what the engine reported.
    assert float(stats["parity_diff_sum"]) == pytest.approx(
        float(np.sum((logp - mb["behaviour_logp"]) * on)), rel=1e-5)


def _episodes(seed, env_only=False):
    """Packed multi-turn episodes over CFG's vocabulary: model turns and environment answers
    (trained False), two to a row."""
    from jaxrl.data.pipeline import pack
    from jaxrl.data.rollouts import Rollout
    from jaxrl.rl.config import RLConfig

    cfg = RLConfig(prompts_per_step=2, group_size=2,
                   engine=EngineConfig(max_concurrent_decodes=4), pack_len=24,
                   microbatch_rows=2, max_prompt_len=4, max_new_tokens=8, prefetch=0)
    rng = np.random.default_rng(seed)
    rollouts = []
    for i in range(cfg.batch_size):
        trained = [False] * 8 if env_only else [True, True, False, False, False, True, True,
                                                True]
        rollouts.append(Rollout(
            prompt=rng.integers(1, CFG.vocab_size, 4).tolist(),
            completion=rng.integers(1, CFG.vocab_size, 8).tolist(),
            logprobs=rng.normal(-3.0, 0.3, 8).tolist(), versions=[0] * 8,
            reward=0.0, advantage=float(rng.normal()), group=i // 2, finish="eos",
            trained=trained))
    packed = pack(rollouts, cfg)
    arrays = {k: v[0] for k, v in packed["arrays"].items()}     # the first microbatch
    return rollouts, arrays, cfg


def _pg_loss_and_grads(model, mb):
    graphdef, params = split_params(model)

    def loss(params):
        loss_sum, _, _ = PolicyGradientLoss(kind="tis")(merge_params(graphdef, params), mb)
        return loss_sum
    return jax.jit(jax.value_and_grad(loss))(params)


def test_an_episode_of_environment_tokens_only_has_no_loss_and_no_gradient(model):
    _, mb, _ = _episodes(0, env_only=True)
    loss, grads = _pg_loss_and_grads(model, mb)
    assert float(loss) == 0.0
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(grads))


def test_environment_tokens_log_probs_do_not_reach_the_gradient(model):
    """The same packed episodes with the environment tokens' reported log-probs changed give the
    same loss and gradients; the model tokens' log-probs do change them."""
    import dataclasses

    from jaxrl.data.pipeline import pack

    rollouts, mb, cfg = _episodes(1)
    env_changed = [dataclasses.replace(r, logprobs=[lp if t else lp - 5.0 for lp, t in
                                                    zip(r.logprobs, r.trained)])
                   for r in rollouts]
    model_changed = [dataclasses.replace(r, logprobs=[lp - 0.5 if t else lp for lp, t in
                                                      zip(r.logprobs, r.trained)])
                     for r in rollouts]
    base = _pg_loss_and_grads(model, mb)
    for changed, same in ((env_changed, True), (model_changed, False)):
        other = _pg_loss_and_grads(model, {k: v[0] for k, v in
                                           pack(changed, cfg)["arrays"].items()})
        leaves = zip(jax.tree.leaves(base[1]), jax.tree.leaves(other[1]))
        if same:
            assert float(other[0]) == float(base[0])
            for a, b in leaves:
                np.testing.assert_array_equal(a, b)
        else:
            assert abs(float(other[0]) - float(base[0])) > 1e-4
