"""LoRA adapters through PEFT's format (jaxrl/models/peft_io.py): a jaxrl model with adapters
exported as a Hugging Face base folder plus a PEFT adapter folder, loaded by the `peft` package
onto `transformers`, gives jaxrl's logits; so does the merged export; and the adapter folder
reads back into the same arrays."""

import dataclasses

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from jaxrl.models import ModelConfig, Transformer, lora, merge_params, to_hf
from jaxrl.models.lora import LoraConfig
from jaxrl.models.peft_io import merged, read_adapter, read_config, write_adapter
from jaxrl.models.transformer import split_params


IDS = np.random.default_rng(0).integers(0, 64, (2, 12)).astype(np.int32)


def _adapted(family, targets=("all-linear",), rslora=False):
    base = ModelConfig(family=family, vocab_size=64, embed_dim=32, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, mlp_dim=48, max_seq_len=32,
                       tie_embeddings=family != "llama", qk_norm=family == "qwen3")
    cfg = dataclasses.replace(base, lora=LoraConfig(rank=4, alpha=12, targets=targets,
                                                    use_rslora=rslora))
    graphdef, params = split_params(Transformer(cfg, rngs=nnx.Rngs(0)))
    keys = iter(jax.random.split(jax.random.key(1), 64))
    layers = {k: (jax.random.normal(next(keys), v.shape) * 0.2 if k.endswith("_lora_b") else v)
              for k, v in params["layers"].items()}
    return base, cfg, graphdef, {**params, "layers": layers}


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()


def _logits(model):
    with torch.no_grad():
        return model(torch.from_numpy(IDS).long()).logits.numpy()


@pytest.mark.parametrize("family,targets,rslora", [
    ("llama", ("all-linear",), False), ("qwen3", ("q_proj", "v_proj", "down_proj"), True)])
def test_peft_loads_the_adapter_onto_transformers_with_jaxrls_logits(tmp_path, family,
                                                                      targets, rslora):
    base, cfg, graphdef, params = _adapted(family, targets, rslora)
    ours = np.asarray(merge_params(graphdef, params)(IDS))
    base_graph, _ = split_params(Transformer(base, rngs=nnx.Rngs(0)))
    to_hf(merge_params(base_graph, lora.frozen(params)), tmp_path / "base")
    write_adapter(params, cfg, tmp_path / "adapter", str(tmp_path / "base"))
    import peft     # here, not at collection: its import takes 3-4 s in every pytest worker

    with_adapter = peft.PeftModel.from_pretrained(_hf(tmp_path / "base"), tmp_path / "adapter")
    np.testing.assert_allclose(_logits(with_adapter), ours, rtol=1e-5, atol=1e-5)
    to_hf(merge_params(base_graph, merged(params, cfg)), tmp_path / "merged")
    np.testing.assert_allclose(_logits(_hf(tmp_path / "merged")), ours, rtol=1e-5, atol=1e-5)
    # PEFT's own merge of our adapter equals our merged export.
    np.testing.assert_allclose(_logits(with_adapter.merge_and_unload()), ours, rtol=1e-5,
                               atol=1e-5)


def test_the_adapter_folder_reads_back_exactly(tmp_path):
    _, cfg, _, params = _adapted("llama")
    write_adapter(params, cfg, tmp_path, "some/base")
    assert read_config(tmp_path) == dataclasses.replace(cfg.lora, targets=lora.TARGETS)
    back = read_adapter(tmp_path, cfg)
    for name, value in lora.trainable(params)["layers"].items():
        np.testing.assert_array_equal(back["layers"][name], value)


def test_an_adapter_for_another_shape_or_kind_is_refused_by_name(tmp_path):
    _, cfg, _, params = _adapted("llama", ("q_proj",))
    write_adapter(params, cfg, tmp_path, "b")
    wider = dataclasses.replace(cfg, embed_dim=64)
    with pytest.raises(ValueError, match=r"q_proj.lora_A.weight is \(4, 32\), expected "
                                         r"\(4, 64\)"):
        read_adapter(tmp_path, wider)
    text = (tmp_path / "adapter_config.json").read_text().replace('"use_dora": false',
                                                                  '"use_dora": true')
    (tmp_path / "adapter_config.json").write_text(text)
    with pytest.raises(ValueError, match=r"uses use_dora=True, which jaxrl's LoRA does not run"):
        read_config(tmp_path)


def test_a_run_starts_from_an_adapter_trained_elsewhere(tmp_path):
    """model.lora.init_from: the folder's rank, alpha and targets become the run's, and the
    fresh train state holds its adapters (and the optimizer state covers them)."""
    import optax

    from jaxrl.config import ConfigError, load_run_config
    from jaxrl.recipe import model_config
    from jaxrl.train.state import init_state, state_shardings
    from sharding import mesh as shd

    _, cfg, _, params = _adapted("llama", ("q_proj", "up_proj"), rslora=True)
    write_adapter(params, cfg, tmp_path / "adapter", "base")
    sizes = ["model.embed_dim=32", "model.num_layers=2", "model.num_heads=4",
             "model.num_kv_heads=2", "model.head_dim=8", "model.mlp_dim=48",
             "model.vocab_size=64", "model.max_seq_len=32", "model.tie_embeddings=false"]
    run = load_run_config(None, [*sizes, f"model.lora.init_from={tmp_path / 'adapter'}"])
    model_cfg = model_config(run)
    assert (model_cfg.lora.rank, model_cfg.lora.alpha, model_cfg.lora.use_rslora) == (4, 12, True)
    assert model_cfg.lora.modules() == ("q_proj", "up_proj")
    mesh = shd.make_mesh(shd.MeshConfig(), jax.devices()[:1])
    tx = optax.adam(1e-3)
    state = init_state(model_cfg, tx, state_shardings(model_cfg, tx, mesh), 0)
    for name, value in lora.trainable(params)["layers"].items():
        np.testing.assert_array_equal(state["params"]["layers"][name], value)
    with pytest.raises(ConfigError, match=r"model.lora.rank=8 but the adapter in "
                                          r"model.lora.init_from=.* has r=4"):
        model_config(load_run_config(None, [*sizes, "model.lora.rank=8",
                                            f"model.lora.init_from={tmp_path / 'adapter'}"]))
    with pytest.raises(ConfigError, match=r"init_from=.*nowhere.*: .* is not a PEFT adapter "
                                          r"folder: no adapter_config.json"):
        model_config(load_run_config(None, [*sizes, f"model.lora.init_from={tmp_path}/nowhere"]))


def _vllm_parse(name: str) -> tuple[str, bool]:
    """vLLM's rule for a PEFT LoRA tensor name (vllm/lora/utils.py,
    `parse_fine_tuned_lora_name`, restated: vLLM is not installed here): strip
    `base_model.model.`, then `<module>.lora_A.weight` / `<module>.lora_B.weight`."""
    if name.startswith("base_model.model."):
        name = name[len("base_model.model."):]
    parts = name.split(".")
    if parts[-1] == "weight" and parts[-2] in ("lora_A", "lora_B"):
        return ".".join(parts[:-2]), parts[-2] == "lora_A"
    raise ValueError(f"{name} is unsupported LoRA weight")


def test_every_adapter_tensor_names_a_linear_module_of_the_base(tmp_path):
    """What vLLM's loader needs: each name parses to a module of the Hugging Face model that is
    an nn.Linear, with A as [r, in_features] and B as [out_features, r]."""
    from safetensors.numpy import load_file

    base, cfg, _, params = _adapted("llama")
    base_graph, _ = split_params(Transformer(base, rngs=nnx.Rngs(0)))
    to_hf(merge_params(base_graph, lora.frozen(params)), tmp_path / "base")
    write_adapter(params, cfg, tmp_path / "adapter", "b")
    modules = dict(_hf(tmp_path / "base").named_modules())
    tensors = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert len(tensors) == 2 * 7 * base.num_layers
    for name, t in tensors.items():
        module, is_a = _vllm_parse(name)
        linear = modules[module]
        assert isinstance(linear, torch.nn.Linear), module
        want = (4, linear.in_features) if is_a else (linear.out_features, 4)
        assert t.shape == want, name
