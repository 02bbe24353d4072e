"""Grammar-constrained decoding (serving/runner/constraints.py) in the engine: a random model's
samples, drawn at temperature 1, parse as the grammar says (checked with `json` and `re`, not with
llguidance), every log-prob is the model's own (a teacher-forced forward), and a request
without a grammar decodes beside them exactly as it would alone."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models import ModelConfig, Transformer, split_params
from jaxrl.models.tokenizer import CharTokenizer
from serving.core.orchestrator import Orchestrator
from serving.core.requests import InvalidRequest
from serving.core.stream import Sample
from serving.fleet.client import RemoteGeneration
from serving.frontends.server import Server
from serving.runner.constraints import Grammars, json_schema_grammar, regex_grammar
from serving.runner.engine import Engine, EngineConfig
from serving.runner.sampling import SamplingParams
from tests.serving.common import byte_bpe_tokenizer

SCHEMA = {"type": "object", "properties": {
    "name": {"enum": ["ann", "bob", "carla"]}, "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}},
    "required": ["name", "ok", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """Byte-level BPE with merges of JSON pieces, as a model folder holds it."""
    texts = [json.dumps({"name": n, "ok": b, "tags": t}) for n in ("ann", "bob", "carla")
             for b in (True, False) for t in ([], ["x"], ["x", "y"])] * 20
    return byte_bpe_tokenizer(tmp_path_factory.mktemp("tokenizer"), texts)


@pytest.fixture(scope="module")
def served(tokenizer):
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size + 5, embed_dim=32, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64, max_seq_len=128)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    engine = Engine(cfg, EngineConfig(max_concurrent_decodes=8, max_len=128,
                                      max_prefill_length=16, prefill_chunk=16))
    grammars = Grammars(tokenizer, cfg.vocab_size)
    with Orchestrator(engine, split_params(model)[1], eos_id=tokenizer.eos_id,
                      grammars=grammars) as o:
        yield o, model


def _check(obj) -> None:
    assert set(obj) == {"name", "ok", "tags"}
    assert obj["name"] in ("ann", "bob", "carla") and isinstance(obj["ok"], bool)
    assert len(obj["tags"]) <= 3 and set(obj["tags"]) <= {"x", "y"}


def _teacher_forced(model, prompt, tokens) -> np.ndarray:
    ids = jnp.asarray([prompt + tokens[:-1]], jnp.int32)
    logp = jax.nn.log_softmax(model(ids)[0].astype(jnp.float32), axis=-1)
    rows = np.arange(len(prompt) - 1, len(prompt) + len(tokens) - 1)
    return np.asarray(logp)[rows, tokens]


def test_samples_parse_as_the_schema_says_with_the_model_s_log_probs(served, tokenizer):
    o, model = served
    prompt = tokenizer.encode('{"name": ') + [5, 9]
    grammar = json_schema_grammar(SCHEMA)
    free = SamplingParams(temperature=0.0, max_tokens=40, stop_at_eos=False)
    alone = o.generate(prompt, free)[0].tokens
    constrained = o.submit(prompt, SamplingParams(temperature=1.0, max_tokens=100, n=6,
                                                  seed=3, grammar=grammar))
    beside = o.submit(prompt, free)
    samples = constrained.result()
    for s in samples:
        assert s.finish_reason == "stop", s
        _check(json.loads(tokenizer.decode(s.tokens)))
        np.testing.assert_allclose(s.logprobs, _teacher_forced(model, prompt, s.tokens),
                                   atol=2e-5)
    assert len({tuple(s.tokens) for s in samples}) > 1        # drawn, not forced
    assert beside.result()[0].tokens == alone    # the other rows' masks allow every token


def test_a_regex_and_the_demo_s_character_tokenizer():
    chars = CharTokenizer()
    cfg = ModelConfig(vocab_size=chars.vocab_size, embed_dim=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8, mlp_dim=32, max_seq_len=64)
    engine = Engine(cfg, EngineConfig(max_concurrent_decodes=4, max_len=64,
                                      max_prefill_length=8, prefill_chunk=8))
    params = split_params(Transformer(cfg, rngs=nnx.Rngs(1)))[1]
    with Orchestrator(engine, params, eos_id=chars.eos_id,
                      grammars=Grammars(chars, cfg.vocab_size)) as o:
        samples = o.generate(chars.encode("12+3="), SamplingParams(
            temperature=1.0, max_tokens=30, n=4, grammar=regex_grammar(r"\(-?[0-9]{1,3}\)")))
    for s in samples:
        assert re.fullmatch(r"\(-?[0-9]{1,3}\)", chars.decode(s.tokens)), s
        assert s.finish_reason == "stop"


def test_bad_grammars_and_engines_without_a_tokenizer_are_refused(served, engine, params):
    o, _ = served
    with pytest.raises(InvalidRequest, match="the grammar is not valid"):
        o.submit([5, 6], SamplingParams(grammar='{"grammars": [{"lark_grammar": "start: x"}]}'))
    with Orchestrator(engine, params) as plain:
        with pytest.raises(InvalidRequest, match="no tokenizer to constrain decoding"):
            plain.submit([5, 6], SamplingParams(grammar=regex_grammar("a+")))
    assert o.generate([5, 6], SamplingParams(max_tokens=3))      # still serving


def test_a_grammar_travels_over_grpc(served, tokenizer):
    """RemoteGeneration carries the grammar to `jaxrl serve`'s Generate
    (serving/frontends/server.py): the same samples as the orchestrator draws in this process, and a
    refusal named."""
    o, _ = served
    own = Orchestrator(o.engine, o.params, eos_id=o.eos_id, grammars=o.grammars).start()
    server = Server(own, port=0, update_token="t").start()    # stops `own` when it stops
    remote = RemoteGeneration(server.address, token="t")
    try:
        prompt = tokenizer.encode('{"name": ')
        sampling = SamplingParams(temperature=1.0, max_tokens=100, n=3, seed=11,
                                  grammar=json_schema_grammar(SCHEMA))
        far = remote.submit(prompt, sampling).result()
        near = o.submit(prompt, sampling).result()
        assert [s.tokens for s in far] == [s.tokens for s in near]
        for s in far:
            _check(json.loads(tokenizer.decode(s.tokens)))
        bad = remote.submit(prompt, SamplingParams(grammar='{"grammars": 5}'))
        assert bad.result()[0].finish_reason == "refused" and "grammar" in bad.error
    finally:
        remote.close()
        server.stop(0)


def test_a_carried_sample_that_breaks_its_grammar_is_refused(served, tokenizer):
    """A group resumed with its samples so far (carry) continues under its grammar; a carried
    sample the grammar cannot have produced is refused at submit, and the engine serves on."""
    o, _ = served
    prompt = tokenizer.encode('{"name": ')
    sampling = SamplingParams(temperature=1.0, max_tokens=100, n=1, seed=2,
                              grammar=json_schema_grammar(SCHEMA))
    [whole] = o.submit(prompt, sampling).result()
    head = Sample(whole.tokens[:4], whole.logprobs[:4], whole.versions[:4])
    [resumed] = o.submit(prompt, sampling, carry=[head]).result()
    assert resumed.tokens == whole.tokens
    wrong = tokenizer.encode("nope")
    broken = Sample(wrong, [-1.0] * len(wrong), [0] * len(wrong))
    with pytest.raises(InvalidRequest, match="carried sample 0: the tokens so far do not"):
        o.submit(prompt, sampling, carry=[broken])
    assert o.generate(prompt, SamplingParams(max_tokens=2))
