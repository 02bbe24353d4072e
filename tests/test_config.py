"""Config loading: defaults <- YAML <- overrides, and errors that name the bad key."""

from pathlib import Path

import pytest

from jaxrl.config import ConfigError, load_run_config, parse_overrides

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_defaults_yaml_and_overrides_layer(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 7\n  batch_size: 16\noptim:\n  lr: 1e-3\n")
    cfg = load_run_config(path, ["train.steps=9", "model.dtype=bfloat16", "task.ops=[+, '*']"])
    assert cfg.train.steps == 9            # override beats YAML
    assert cfg.train.batch_size == 16      # YAML beats default
    assert cfg.optim.lr == 1e-3            # "1e-3" read as a number
    assert cfg.train.seq_len == 16         # the dataclass default
    assert cfg.model.dtype == "bfloat16"
    assert cfg.task.ops == ("+", "*")


def test_every_shipped_config_loads():
    paths = sorted(CONFIGS.glob("*.yaml"))
    assert paths
    for path in paths:
        load_run_config(path)


def test_the_previous_release_s_engine_keys_still_work_from_python_with_a_warning():
    from jaxrl.rl.config import RLConfig

    with pytest.warns(DeprecationWarning, match=r"RLConfig\(slots=\.\.\.\) is deprecated: pass "
                                                r"rl.engine.max_concurrent_decodes"):
        old = RLConfig(slots=4, group_size=2, engine_attention="loop")
    assert old.engine.max_concurrent_decodes == 4 and old.engine.attention == "loop"
    with pytest.raises(ValueError, match="rl.group_size=8 exceeds"):
        with pytest.warns(DeprecationWarning):
            RLConfig(slots=4, group_size=8)


@pytest.mark.parametrize("overrides, message", [
    (["train.stepz=3"], r"unknown config key 'train.stepz'; section 'train' allows: steps,"),
    (["bogus=1"], r"unknown config key 'bogus'; the top level allows: run_dir"),
    (["model.dtype=int8"], r"model.dtype='int8' is not allowed; choose one of: 'float32'"),
    (["train.steps=abc"], r"train.steps='abc': expected an integer"),
    (["train.steps=1", "train.steps=2"], r"override key 'train.steps' is given twice"),
    (["train.batch_size=10", "train.microbatches=3"],
     r"train.microbatches=3 does not divide train.batch_size=10"),
    (["model.num_heads=6", "model.num_kv_heads=4"],
     r"model.num_kv_heads=4 must divide model.num_heads=6"),
    (["rl.rollout_correction=clip"], r"rl.rollout_correction='clip' is not allowed; choose one "
                                     r"of: 'none', 'icepop', 'seq_mis', 'geo_mis'"),
    (["rl.rollout_correction=icepop", "rl.correction_high=0.9"],
     r"rl.correction_low=0.5 and rl.correction_high=0.9 must satisfy 0 <= low < 1 < high"),
    (["mesh.fsdp=-1", "mesh.data=-1"], r"at most one mesh axis may be -1"),
    (["train.seq_len=100", "model.max_seq_len=64"],
     r"train.seq_len=100 exceeds model.max_seq_len=64"),
    (["hf_path=/x", "model.embed_dim=8"], r"model.embed_dim conflicts with hf_path"),
    (["train.steps"], r"not of the form section.key=value"),
    # The engine's settings are EngineConfig's, in rl.engine; the earlier keys name their new
    # ones, and what the run sets itself is refused with what it follows from.
    (["rl.slots=8"], r"config key 'rl.slots' is now 'rl.engine.max_concurrent_decodes'"),
    (["rl.engine_attention=loop"], r"config key 'rl.engine_attention' is now "
                                   r"'rl.engine.attention'"),
    (["rl.engine_kv_cache_dtype=fp8"], r"'rl.engine_kv_cache_dtype' is now "
                                       r"'rl.engine.kv_cache_dtype'"),
    (["rl.engine.max_len=4096"], r"rl.engine.max_len follows from rl.max_prompt_len \+ "
                                 r"rl.max_new_tokens"),
    (["rl.engine.dtype=bfloat16"], r"rl.engine.dtype follows from model.dtype"),
    (["rl.engine.attention=flash"], r"attention='flash' is not one of"),
    (["rl.engine.max_concurrent_decodes=4", "rl.group_size=8"],
     r"rl.group_size=8 exceeds rl.engine.max_concurrent_decodes=4"),
])
def test_bad_config_names_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(CONFIGS / "demo_cpu.yaml", overrides)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_run_config(tmp_path / "nope.yaml")


def test_parse_overrides_nests():
    assert parse_overrides(["a.b.c=1", "a.d=x", "e=true"]) == {
        "a": {"b": {"c": 1}, "d": "x"}, "e": True}


def test_splash_attention_asks_for_whole_blocks_naming_the_nearest():
    from jaxrl.config import ConfigError, load_run_config

    with pytest.raises(ConfigError, match=r"train.seq_len=200 is not a multiple of splash "
                                          r"attention's 128-token block \(nearest: 128 or 256\)"):
        load_run_config(None, ["model.attention=splash", "train.seq_len=200",
                               "model.max_seq_len=256"])
    with pytest.raises(ConfigError, match=r"rl.pack_len=60 .* \(nearest: 128\)"):
        load_run_config(None, ["model.attention=splash", "train.seq_len=128", "rl.steps=5",
                               "rl.pack_len=60", "model.max_seq_len=256"])
    load_run_config(None, ["model.attention=splash", "train.seq_len=256",
                           "model.max_seq_len=256"])


def test_context_parallelism_names_each_length_and_what_it_does_not_run_yet():
    from jaxrl.config import ConfigError, load_run_config

    with pytest.raises(ConfigError, match=r"mesh.context=4: train.seq_len=100 must be a multiple "
                                          r"of 2 x mesh.context = 8 .*; rl.pack_len=60 must be "
                                          r".*; a pipeline \(sharding.pipeline.stages=2\) is not "
                                          r"supported with it yet"):
        load_run_config(None, ["mesh.context=4", "train.seq_len=100", "rl.steps=5",
                               "rl.pack_len=60", "sharding.pipeline.stages=2"])
    with pytest.raises(ConfigError, match=r"sliding-window attention \(model.sliding_window=16"):
        load_run_config(None, ["mesh.context=2", "model.family=gemma2",
                               "model.sliding_window=16"])
    cfg = load_run_config(None, ["mesh.context=4", "train.seq_len=128"])
    assert cfg.mesh.context == 4


def test_cudnn_attention_refuses_what_the_kernel_cannot_take():
    from jaxrl.config import ConfigError, load_run_config

    with pytest.raises(ConfigError, match=r"model.attention=cudnn: model.dtype=float32 .*; "
                                          r"model.head_dim=12 \(a multiple of 8, at most 256\); "
                                          r"rl.max_segments=32 above model.max_segments=16"):
        load_run_config(None, ["model.attention=cudnn", "model.head_dim=12", "rl.steps=5",
                               "rl.max_segments=32"])
    cfg = load_run_config(None, ["model.attention=cudnn", "model.dtype=bfloat16", "rl.steps=5",
                                 "rl.max_segments=32", "model.max_segments=32"])
    assert cfg.model.max_segments == 32
