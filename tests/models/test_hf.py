"""Logits parity with Hugging Face transformers (PyTorch, CPU) for each supported family."""

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
import transformers

from jaxrl.models import from_hf, load_hf_config, to_hf
from jaxrl.models.hf import HFCheckpointError

FAMILIES = {
    # Llama 3.1: GQA, llama3 RoPE scaling, untied head.
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    # Qwen2.5: q/k/v bias, tied embeddings.
    "qwen2": lambda: transformers.Qwen2Config(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    # Qwen3: q/k RMSNorm and an explicit head_dim that is not hidden/heads.
    "qwen3": lambda: transformers.Qwen3Config(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=128,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    # Qwen3-MoE: 6 experts of which each token takes 3, top-k weights renormalised.
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=128, num_experts=6, num_experts_per_tok=3,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    # Gemma 2: sandwich norms, GeGLU, scaled embedding, a query scale that is not head_dim,
    # attention and final-logit soft-caps small enough to bite, and sliding layers (every
    # other one) whose window, 4, is shorter than the 13-token test sequence.
    "gemma2": lambda: transformers.Gemma2Config(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
        sliding_window=4),
    # Gemma 3: q/k norms, sliding layers with their own RoPE base, the full layer's RoPE
    # linearly scaled, a layer pattern given explicitly, untied head.
    "gemma3": lambda: transformers.Gemma3TextConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
        query_pre_attn_scalar=32, sliding_window=5, tie_word_embeddings=False,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                            "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}),
}


def _random_hf_model(config):
    torch.manual_seed(0)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:  # biases too, so that every tensor's mapping is exercised
                p.copy_(0.2 * torch.randn_like(p))
    return model


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.from_numpy(ids).long()).logits.numpy()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def hf_checkpoint(request, tmp_path_factory):
    family = request.param
    model = _random_hf_model(FAMILIES[family]())
    path = tmp_path_factory.mktemp(family)
    # Qwen2 is written as a sharded index so both reading paths are covered.
    model.save_pretrained(path, max_shard_size="100KB" if family == "qwen2" else "5GB")
    ids = np.random.default_rng(1).integers(0, 97, size=(2, 13)).astype(np.int32)
    return family, path, ids, _hf_logits(model, ids)


def test_logits_match_transformers(hf_checkpoint, report_table):
    family, path, ids, expected = hf_checkpoint
    if family == "qwen2":
        assert (path / "model.safetensors.index.json").exists()
    model = from_hf(path, dtype="float32")
    got = np.asarray(model(ids))
    diff = float(np.max(np.abs(got - expected)))
    report_table("logits parity vs transformers (float32, max abs diff)",
                 ("family", "check", "max_abs_diff", "limit"),
                 (family, "from_hf", f"{diff:.2e}", "1e-4"))
    assert got.shape == expected.shape
    assert diff <= 1e-4


@pytest.mark.parametrize("scan_layers", ["scan", "unroll"])
def test_scanned_and_unrolled_layer_stacks_both_match_transformers(hf_checkpoint, scan_layers):
    family, path, ids, expected = hf_checkpoint
    model = from_hf(path, dtype="float32")
    model.cfg = dataclasses.replace(model.cfg, scan_layers=scan_layers)
    np.testing.assert_allclose(np.asarray(model(ids)), expected, rtol=0, atol=1e-4)


def test_round_trip_through_to_hf(hf_checkpoint, tmp_path, report_table):
    family, path, ids, expected = hf_checkpoint
    to_hf(from_hf(path, dtype="float32"), tmp_path / "out")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", dtype=torch.float32, attn_implementation="eager").eval()
    original = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    got = _hf_logits(reloaded, ids)
    diff = float(np.max(np.abs(got - expected)))
    report_table("logits parity vs transformers (float32, max abs diff)",
                 ("family", "check", "max_abs_diff", "limit"),
                 (family, "from_hf->to_hf->transformers", f"{diff:.2e}", "1e-4"))
    assert type(reloaded).__name__ == type(original).__name__
    for (name, a), (_, b) in zip(sorted(reloaded.state_dict().items()),
                                 sorted(original.state_dict().items())):
        assert torch.equal(a, b), name
    assert diff <= 1e-4


def test_bf16_weights_load(hf_checkpoint):
    family, path, ids, expected = hf_checkpoint
    model = from_hf(path, dtype="bfloat16", param_dtype="float32")
    assert model.embed[...].dtype == np.float32
    got = np.asarray(model(ids))
    # bf16 compute: close, not exact (HF's float32 logits span roughly +-10 here)
    assert np.max(np.abs(got - expected)) < 0.5


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unsupported_architecture(hf_checkpoint, tmp_path):
    _, path, _, _ = hf_checkpoint
    bad = _copy(path, tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFCheckpointError, match="model_type='gpt2'.*supported: llama, qwen2"):
        load_hf_config(bad)


def test_missing_and_misshaped_tensors(tmp_path):
    from safetensors.numpy import load_file, save_file

    model = _random_hf_model(FAMILIES["llama"]())
    model.save_pretrained(tmp_path / "ok")
    tensors = load_file(tmp_path / "ok" / "model.safetensors")

    missing = _copy(tmp_path / "ok", tmp_path / "missing")
    name = "model.layers.1.self_attn.k_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != name}, missing / "model.safetensors")
    with pytest.raises(HFCheckpointError, match=f"missing tensor '{name}'"):
        from_hf(missing)

    misshaped = _copy(tmp_path / "ok", tmp_path / "misshaped")
    name = "model.layers.0.mlp.up_proj.weight"
    save_file({**tensors, name: tensors[name][:, :-1].copy()}, misshaped / "model.safetensors")
    with pytest.raises(HFCheckpointError, match=rf"'{name}'.*shape \(96, 63\), expected \(96, 64\)"):
        from_hf(misshaped)

    with pytest.raises(HFCheckpointError, match="no config.json"):
        from_hf(tmp_path / "nowhere")


@pytest.mark.multi_device
def test_from_hf_places_each_tensor_on_the_mesh(hf_checkpoint):
    from jaxrl.models import abstract_model, param_axes, split_params
    from sharding.mesh import MeshConfig, make_mesh, tree_shardings

    family, path, ids, expected = hf_checkpoint
    cfg = load_hf_config(path)
    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2))
    shardings = tree_shardings(param_axes(cfg), split_params(abstract_model(cfg))[1], mesh)
    model = from_hf(path, shardings=shardings)
    q = model.layers.q_proj[...]  # [L, D, N, H]: embed over fsdp, query heads over tensor
    assert q.sharding == shardings["layers"]["q_proj"]
    L, D, N, H = q.shape
    assert {s.data.shape for s in q.addressable_shards} == {(L, D // 4, N // 2, H)}
    np.testing.assert_allclose(np.asarray(model(ids)), expected, atol=1e-4)


def test_moe_load_balancing_loss_equals_transformers(tmp_path):
    """Qwen3-MoE with output_router_logits: transformers' training loss (cross-entropy plus
    router_aux_loss_coef times its load_balancing_loss_func over every layer's router logits)
    against SupervisedLoss on the same tokens, and its gradient on the routers; the setting
    survives from_hf and to_hf."""
    import jax

    from jaxrl.models import merge_params, split_params
    from jaxrl.train.objectives import SupervisedLoss

    config = FAMILIES["qwen3_moe"]()
    config.output_router_logits, config.router_aux_loss_coef = True, 0.25
    hf = _random_hf_model(config)
    hf.save_pretrained(tmp_path / "in")
    ids = np.random.default_rng(2).integers(0, 97, size=(2, 11)).astype(np.int32)
    out = hf(torch.from_numpy(ids).long(), labels=torch.from_numpy(ids).long())
    out.loss.backward()
    assert float(out.aux_loss.detach()) > 0

    model = from_hf(tmp_path / "in", dtype="float32")
    assert model.cfg.router_aux_loss_coef == 0.25
    mask = np.ones(ids.shape, np.float32)
    mask[:, -1] = 0                        # transformers predicts tokens 1..T-1
    mb = {"input_ids": ids, "targets": np.roll(ids, -1, axis=1), "loss_mask": mask}
    graphdef, params = split_params(model)

    def loss(p):
        loss_sum, weight, stats = SupervisedLoss()(merge_params(graphdef, p), mb)
        return loss_sum / weight, stats

    (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(params)
    np.testing.assert_allclose(float(value), float(out.loss), rtol=1e-5)
    summary = SupervisedLoss().summarize(stats)
    np.testing.assert_allclose(float(summary["router_aux_loss"]), float(out.aux_loss),
                               rtol=1e-5)
    want = np.stack([layer.mlp.gate.weight.grad.numpy().T for layer in hf.model.layers])
    np.testing.assert_allclose(np.asarray(grads["layers"]["router"]), want, atol=1e-5)

    to_hf(model, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["output_router_logits"] and written["router_aux_loss_coef"] == 0.25
