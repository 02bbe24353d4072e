"""Gemma 2 and Gemma 3 decode past their sliding window as Hugging Face's `generate` does: through
the contiguous KV cache (`greedy_generate`) and through the serving engine's paged pool (pages
of 4 tokens, prompts prefilled in chunks of 4, so windows and pages cross at every offset).
Logits parity, the export round trip and bad configs are in test_hf.py."""

import numpy as np
import pytest
import torch
import transformers

from jaxrl.models import from_hf, split_params
from jaxrl.models.generate import greedy_generate
from jaxrl.train.objectives import token_logp
from serving.core.orchestrator import Orchestrator
from serving.runner.engine import Engine, EngineConfig
from serving.runner.sampling import SamplingParams

WINDOW = 5
NEW_TOKENS = 24        # prompts of 3 to 11 tokens: every sequence ends well past the window

CONFIGS = {
    "gemma2": lambda: transformers.Gemma2Config(
        vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        query_pre_attn_scalar=12, attn_logit_softcapping=4.0, final_logit_softcapping=8.0,
        sliding_window=WINDOW, tie_word_embeddings=False),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        query_pre_attn_scalar=8, sliding_window=WINDOW, tie_word_embeddings=False,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}}),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def gemma(request, tmp_path_factory):
    """(our model, Hugging Face's, its greedy continuations of three prompts, the prompts)."""
    torch.manual_seed(0)
    config = CONFIGS[request.param]()
    config._attn_implementation = "eager"
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    # Wide weights, so that the next token is rarely a near tie; an untied head and a small
    # embedding (Gemma scales it by sqrt(hidden)), so that it is not each token's own.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            scale = 0.1 if name.endswith("norm.weight") or "embed" in name else 0.3
            p.copy_(scale * torch.randn_like(p))
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 61, size=n).tolist() for n in (3, 11, 7)]
    want = []
    for prompt in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
        want.append(out[0, len(prompt):].tolist())
    return from_hf(path), hf, want, prompts


def test_packed_rows_attend_within_their_segment_and_window(gemma):
    """The train step's layout: three sequences packed in one row (positions restarting, padding
    after), each position's logits equal to Hugging Face's on that sequence alone."""
    model, hf, _, prompts = gemma
    ids = np.zeros((1, 24), np.int32)
    positions, segments = np.zeros_like(ids), np.zeros_like(ids)
    start = 0
    for k, prompt in enumerate(prompts):
        end = start + len(prompt)
        ids[0, start:end], positions[0, start:end] = prompt, np.arange(len(prompt))
        segments[0, start:end] = k + 1
        start = end
    targets = np.roll(ids, -1, axis=1)
    logits = np.asarray(model(ids, positions, segments))[0]
    # The trainer's log-probs: chunked over positions, the final soft-cap applied in each chunk.
    logp = np.asarray(token_logp(model, {"input_ids": ids, "positions": positions,
                                         "segment_ids": segments, "targets": targets},
                                 chunk=8)[0])[0]
    start = 0
    for prompt in prompts:
        end = start + len(prompt)
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0]
        np.testing.assert_allclose(logits[start:end], want.numpy(), atol=1e-4)
        want_logp = torch.log_softmax(want, -1)[torch.arange(len(prompt) - 1),
                                                torch.tensor(prompt[1:])].numpy()
        np.testing.assert_allclose(logp[start:end - 1], want_logp, atol=1e-4)
        start = end


def test_greedy_decoding_past_the_window_equals_transformers(gemma):
    model, _, want, prompts = gemma
    assert any(model.cfg.sliding_layers()) and model.cfg.sliding_window == WINDOW
    assert greedy_generate(model, prompts, NEW_TOKENS, eos_id=-1) == want


@pytest.mark.slow
def test_the_paged_engine_decodes_past_the_window_as_transformers_does(gemma):
    model, _, want, prompts = gemma
    engine = Engine(model.cfg, EngineConfig(max_concurrent_decodes=2, max_len=48,
                                            max_prefill_length=16, prefill_chunk=4,
                                            page_size=4, min_bucket=4))
    with Orchestrator(engine, split_params(model)[1]) as o:
        greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
        streams = [o.submit(p, greedy) for p in prompts]
        got = [s.result()[0].tokens for s in streams]
    assert got == want
