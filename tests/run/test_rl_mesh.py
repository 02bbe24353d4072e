"""The RL loop on a mesh of eight CPU devices (partial rollouts on one: test_rl.py): async,
colocated, learns and, interrupted mid-way, resumes the same rollout stream; sync with split
placement (4 devices train, 4 serve) learns and keeps trainer and engine apart; sampler and
trainer log-probs agree; the KL reference survives a resume through a pipeline; the trainer
keeps pipeline order inside and canonical order outside; the step compiled beside the engine
is the jitted step; bad configurations are refused naming the values."""

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxrl.commands import job
from jaxrl.config import ConfigError
from jaxrl.data.rollouts import Rollout
from jaxrl.rollout import generation
from jaxrl.rollout.actor import Actor
from jaxrl.telemetry import rl_metrics
from jaxrl.train.checkpoint import Checkpointer
from jaxrl.trainer import rl_trainer
from jaxrl.trainer import trainer as trainer_module
from tests.run.test_rl import (
    RL_STEPS,
    WARMUP,
    assert_log_probs_agree,
    assert_reward_rises,
    config,
    quiet,
    rl_rows,
    rl_run_dir,
    rl_steps,
    warm_up,
)

pytestmark = [pytest.mark.multi_device, pytest.mark.slow]


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    return warm_up(tmp_path_factory)


class Interrupted(Exception):
    pass


SAVED = WARMUP + 10   # the async run's checkpoint it resumes from


@pytest.fixture(scope="module")
def async_run(warm, tmp_path_factory, request):
    """Async, colocated, checkpoints every 10 steps, for RL_STEPS (14 when its learning
    threshold is not run: 4 after the resume). The first run is interrupted after training
    step SAVED + 1 (before its metrics and before any checkpoint of it); the second continues
    from the checkpoint at SAVED to the end. Records what each run trained at every step and
    which problems its actor submitted."""
    steps = rl_steps(request, RL_STEPS, 14)
    run_dir = rl_run_dir(warm, tmp_path_factory.mktemp("async"))
    cfg = config(run_dir, "rl.mode=async", "checkpoint.every=10", f"rl.steps={steps}")
    out = {"cfg": cfg, "run_dir": run_dir, "steps": steps, "trained": {"a": {}, "b": {}},
           "submitted": {"a": [], "b": []}, "lines": []}
    current = ["a"]
    batch_stats, problem = rl_metrics.batch_stats, Actor.problem

    def record_batch(rollouts, step):   # once per optimizer step, after it trained
        out["trained"][current[0]][step + 1] = list(rollouts)
        if current[0] == "a" and step + 1 == SAVED + 1:
            raise Interrupted()
        return batch_stats(rollouts, step)

    def record_problem(self, index):    # once per group submitted to the engine
        out["submitted"][current[0]].append(index)
        return problem(self, index)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rl_metrics, "batch_stats", record_batch)
        mp.setattr(Actor, "problem", record_problem)
        with pytest.raises(Interrupted):
            job.run(cfg, log=quiet)
        ckpt = Checkpointer(run_dir / "checkpoints")
        out["latest_after_interrupt"] = ckpt.latest_step()
        out["saved"] = ckpt.saved_data(SAVED)
        ckpt.close()
        current[0] = "b"
        job.run(cfg, log=out["lines"].append)
    ckpt = Checkpointer(run_dir / "checkpoints")
    out["final"] = ckpt.saved_data(WARMUP + steps)
    ckpt.close()
    return out


@pytest.fixture(scope="module")
def sync_split_run(warm, tmp_path_factory):
    """Sync, split placement: devices 0-3 train (fsdp=4), devices 4-7 serve, and with
    rl.multiplex devices 0-3 also generate while the trainer waits. Records the in-process
    orchestrators and the device sets of the trainer state the loop checkpoints."""
    served, saved = [], []

    class RecordingOrchestrator(generation.Orchestrator):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            served.append(self)

    class RecordingCheckpointer(trainer_module.Checkpointer):
        def save(self, state, *args, **kwargs):
            saved.append(jax.tree.map(lambda a: frozenset(a.sharding.device_set), state))
            return super().save(state, *args, **kwargs)

    run_dir = rl_run_dir(warm, tmp_path_factory.mktemp("sync_split"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(generation, "Orchestrator", RecordingOrchestrator)
        mp.setattr(trainer_module, "Checkpointer", RecordingCheckpointer)
        summary = job.run(config(run_dir, "rl.mode=sync", "rl.placement=split",
                                 "rl.engine_devices=4", "rl.multiplex=true"), log=quiet)
    return {"run_dir": run_dir, "steps": RL_STEPS, "summary": summary, "served": served,
            "saved": saved}


@pytest.mark.parametrize("run", [pytest.param("async_run", marks=pytest.mark.learning),
                                 "sync_split_run"])
def test_reward_rises(request, run, report_table):
    fixture = request.getfixturevalue(run)
    assert_reward_rises(run, fixture["run_dir"], fixture["steps"], report_table)


# -- placement ---------------------------------------------------------------------------------

def test_split_placement_keeps_trainer_and_engine_apart(sync_split_run):
    devices = jax.devices()
    trainer, serving = frozenset(devices[:4]), frozenset(devices[4:])
    local, lender = sync_split_run["served"]      # the engine, then the trainer's own
    assert frozenset(local.engine.mesh.devices.flat) == serving
    assert {frozenset(a.sharding.device_set) for a in jax.tree.leaves(local.params)} == {serving}
    assert frozenset(lender.engine.mesh.devices.flat) == trainer
    assert lender.version == local.version
    # every step's groups were placed while the trainer waited: on both engines
    rows = rl_rows(sync_split_run["run_dir"])
    assert all(0 < r["trainer_generated_share"] < 1 for r in rows), rows
    # The trainer's whole state (parameters, AdamW moments, step, rng) lives on its 4 devices.
    (state,) = sync_split_run["saved"]   # saved once, at the last step
    assert set(jax.tree.leaves(state)) == {trainer}
    assert local.version == WARMUP + RL_STEPS   # the engine got the last step's weights


# -- resume ------------------------------------------------------------------------------------

def test_resume_mid_run_continues_the_stream(async_run):
    run_dir, trained, submitted = async_run["run_dir"], async_run["trained"], async_run["submitted"]
    saved, group_size = async_run["saved"], async_run["cfg"].rl.group_size
    assert async_run["latest_after_interrupt"] == SAVED
    assert f"resumed RL from {run_dir.absolute() / 'checkpoints'}/{SAVED}" in async_run["lines"]
    end = WARMUP + async_run["steps"]
    assert sorted(trained["b"]) == list(range(SAVED + 1, end + 1))

    # metrics.jsonl continues: the first run's steps up to the checkpoint, then the second's;
    # the resumed clock continues from the saved one.
    rows = rl_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(WARMUP + 1, end + 1))
    assert rows[SAVED - WARMUP]["time_s"] >= rows[SAVED - WARMUP - 1]["time_s"]

    # The resumed run first trains the rollouts the checkpoint kept (generated, not yet trained) ...
    tail = [Rollout.from_json(r) for r in saved["rollouts"]]
    resumed = [r for step in sorted(trained["b"]) for r in trained["b"][step]]
    assert resumed[:len(tail)] == tail
    # ... redoes the groups that were in flight, then takes new problems from next_problem on.
    redo, next_problem = saved["redo"], saved["next_problem"]
    new = submitted["b"][len(redo):]
    assert submitted["b"][:len(redo)] == redo and new
    assert new == list(range(next_problem, next_problem + len(new)))
    assert all(r.group in redo or r.group >= next_problem for r in resumed[len(tail):])
    assert async_run["final"]["next_problem"] > next_problem
    # No sample is trained twice: per group, the samples trained up to the checkpoint and after
    # it add up to at most one group (a group may straddle the checkpoint).
    before = [r for step in range(WARMUP + 1, SAVED + 1) for r in trained["a"][step]]
    groups = [r.group for r in before + resumed]
    assert max(groups.count(g) for g in set(groups)) <= group_size


# -- bad configurations ------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (["rl.placement=split", "rl.engine_devices=8"],
     r"rl.placement=split with rl.engine_devices=8 leaves no device to train on \(8 devices\)"),
    (["rl.microbatch_rows=12"],
     r"rl.microbatch_rows=12 is not divisible by the 8-way data-parallel trainer mesh"),
    (["rl.placement=split", "rl.engine_devices=4", "rl.microbatch_rows=6"],
     r"rl.microbatch_rows=6 is not divisible by the 4-way data-parallel trainer mesh"),
    (["rl.max_prompt_len=24", "rl.max_new_tokens=16", "rl.pack_len=64"],
     r"rl.max_prompt_len \+ rl.max_new_tokens = 40 exceeds the model's max_seq_len=32"),
    (["rl.moe_routing=replay"],
     (r"rl.moe_routing=replay replays a mixture-of-experts model's routing; model.family=llama "
      r"has no experts")),
], ids=["engine_devices", "microbatch_rows", "microbatch_rows_split", "max_seq_len",
        "moe_routing"])
def test_bad_rl_config_is_refused_naming_the_values(warm, tmp_path, overrides, message):
    run_dir = rl_run_dir(warm, tmp_path)
    with pytest.raises(ConfigError, match=message):
        job.run(config(run_dir, *overrides), log=quiet)
    assert not (run_dir / "metrics.jsonl").exists()



def test_sampler_and_trainer_log_probs_agree_in_float32(sync_split_run, async_run):
    """Sync trains on lag-0 tokens almost only, so nearly all are measured; async measures the
    lag-0 tokens it has (test_rl.py: assert_log_probs_agree)."""
    rows = rl_rows(sync_split_run["run_dir"])
    counted = sum(r["logprob_parity_tokens"] for r in rows)
    assert counted >= 0.9 * sum(r["trained_tokens"] for r in rows)
    assert_log_probs_agree(rows)
    assert_log_probs_agree(rl_rows(async_run["run_dir"]))


# -- the KL term against a frozen reference model ---------------------------------------------

def test_a_kl_run_keeps_its_reference_model_across_a_resume(warm, tmp_path):
    """`rl.kl_coef > 0` through a pipeline (zb-h1: the reference runs in the table's R ops):
    the trainer starts a reference copy of the warm-up's weights, checkpoints it with the
    state, and a resumed run restores it (the reference never moves while the policy does)."""
    run_dir = rl_run_dir(warm, tmp_path)
    layout = ["rl.kl_coef=0.05", "rl.mode=sync", "rl.prompts_per_step=4", "rl.group_size=4",
              "checkpoint.every=1", "sharding.pipeline.stages=2",
              "sharding.pipeline.microbatches=2", "sharding.pipeline.schedule=zb-h1"]
    job.run(config(run_dir, *layout, "rl.steps=1"), log=quiet)
    lines = []
    job.run(config(run_dir, *layout, "rl.steps=2"), log=lines.append)
    assert any(f"resumed RL from {run_dir / 'checkpoints'}/{WARMUP + 1}" in x for x in lines)
    rows = rl_rows(run_dir)
    assert [r["step"] for r in rows] == [WARMUP + 1, WARMUP + 2]
    # The policy has moved away from the reference by the second step, not at the first.
    assert rows[0]["kl_ref"] == pytest.approx(0.0, abs=1e-6) and rows[1]["kl_ref"] > 0
    manager = ocp.CheckpointManager(run_dir / "checkpoints")
    try:
        start = manager.restore(WARMUP, args=ocp.args.Composite(
            params=ocp.args.StandardRestore())).params
        end = manager.restore(WARMUP + 2, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(), ref_params=ocp.args.StandardRestore()))
        policy, end = end.params, end.ref_params
    finally:
        manager.close()
    for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(end)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(policy)))


def test_the_rl_trainer_keeps_pipeline_order_inside_and_canonical_outside(tmp_path):
    """Under V-Half the RL trainer's state (policy and KL reference) keeps its layer stack in
    pipeline order (sharding/layer_order.py), while the weights it serves and the checkpoint
    it writes are in canonical order: equal to the model initialised from the same seed, and
    readable by plain Orbax."""
    from flax import nnx

    from jaxrl.models import Transformer
    from jaxrl.models.transformer import split_params
    from jaxrl.recipe import model_config
    from sharding import mesh as shd
    from sharding.layer_order import LayerOrder

    cfg = config(tmp_path / "run", "train.steps=0", "model.num_layers=4", "rl.kl_coef=0.1",
                 "sharding.pipeline.stages=2", "sharding.pipeline.microbatches=4",
                 "sharding.pipeline.schedule=v-half")
    model_cfg = model_config(cfg)
    trainer = rl_trainer.RLTrainer(cfg, model_cfg, shd.make_mesh(cfg.mesh), log=quiet)
    try:
        # (initialised under jit: equal to the eager init up to rounding)
        init = split_params(Transformer(model_cfg, rngs=nnx.Rngs(cfg.train.seed)))[1]
        want = jax.device_get(trainer.params)
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(init)):
            np.testing.assert_allclose(a, np.asarray(b), rtol=1e-5, atol=1e-7)
        order = LayerOrder.for_pipeline(cfg.sharding.pipeline, model_cfg.num_layers)
        assert order.permutation == (0, 3, 1, 2)
        for got in (trainer.state["params"], trainer.state["ref_params"]):
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(order.to_pipeline(want))):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        trainer.save({}, {"note": "test"})
    finally:
        trainer.close()
    manager = ocp.CheckpointManager(tmp_path / "run" / "checkpoints")
    try:
        saved = manager.restore(0, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(), ref_params=ocp.args.StandardRestore()))
    finally:
        manager.close()
    for tree in (saved.params, saved.ref_params):
        for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_step_compiled_beside_the_engine_is_the_jitted_step(tmp_path):
    """RL compiles its train step in a thread of its own while the engine compiles
    (Trainer.compile_async): the first step runs that executable and gives the state and
    metrics the jitted step gives; a batch of another shape goes through the jitted step."""
    from jaxrl.data.pipeline import pack
    from jaxrl.recipe import model_config
    from sharding import mesh as shd

    rng = np.random.default_rng(0)
    rollouts = [Rollout(prompt=[1, 5, 6], completion=rng.integers(3, 20, 4).tolist(),
                        logprobs=(-rng.random(4)).tolist(), versions=[0] * 4, reward=0.0,
                        advantage=float(rng.normal()), group=i // 8, finish="length")
                for i in range(16)]
    trainers, results = [], []
    try:
        for name in ("ahead", "jitted"):
            cfg = config(tmp_path / name, "train.steps=0")
            trainer = rl_trainer.RLTrainer(cfg, model_config(cfg), shd.make_mesh(cfg.mesh),
                                           log=quiet)
            trainers.append(trainer)
            if name == "ahead":
                trainer.compile_async(pack([], cfg.rl)["arrays"])
            batch = jax.device_put(pack(rollouts, cfg.rl)["arrays"], trainer.batch_sharding)
            results.append((trainer.train(batch), jax.device_get(trainer.params)))
        ahead = trainers[0]
        assert ahead._executable(batch) is ahead._compiled[1]
        assert trainers[1]._compiled is None
        assert results[0][0] == results[1][0]
        for a, b in zip(jax.tree.leaves(results[0][1]), jax.tree.leaves(results[1][1])):
            np.testing.assert_array_equal(a, b)
        fewer = {k: v[:, :16] for k, v in batch.items()}
        assert ahead._executable(fewer) is ahead._step_fn
    finally:
        for trainer in trainers:
            trainer.close()
