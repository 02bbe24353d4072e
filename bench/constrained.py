"""Constrained decoding: the time per generated token under a JSON-schema grammar against free text.

One engine, one random model, a byte-level BPE tokenizer trained here on JSON text; the same
requests (`--requests` prompts x `--n` samples at temperature 1) decoded free (no EOS stop, so
every sample runs to `--tokens`) and under a JSON schema (each sample ends when its object is
complete), taking turns for `--rounds` rounds. Constrained samples are shorter, so the figure
compared is wall time per generated token; the host's share of it (llguidance's masks, per
row and step) is timed on its own.

    jaxrl bench constrained [--requests 8 --n 4 --tokens 96 --vocab 2000]
    (or: .venv/bin/python bench/constrained.py ...)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from flax import nnx  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from jaxrl.models import ModelConfig, Transformer, split_params  # noqa: E402
from jaxrl.models.tokenizer import HFTokenizer  # noqa: E402
from serving.core.orchestrator import Orchestrator  # noqa: E402
from serving.runner.constraints import Grammars, json_schema_grammar  # noqa: E402
from serving.runner.engine import Engine, EngineConfig  # noqa: E402
from serving.runner.sampling import SamplingParams  # noqa: E402

# Bounded, so that a random model's samples end (an unbounded integer or free whitespace
# would let them run to max_tokens): llguidance's own option for compact JSON.
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "population": {"type": "integer", "minimum": 0, "maximum": 99999},
    "tags": {"type": "array", "items": {"enum": ["north", "south", "coast"]}, "maxItems": 3},
    "capital": {"type": "boolean"}}, "required": ["city", "population", "tags", "capital"],
    "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}


def tokenizer(vocab: int, work: Path) -> HFTokenizer:
    """Byte-level BPE trained on JSON objects of SCHEMA's shape (a model folder's kind)."""
    texts = [json.dumps({"city": f"town{i}", "population": i * 137, "tags": ["north"][: i % 2],
                         "capital": i % 3 == 0}) for i in range(2000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(work / "tokenizer.json"))
    (work / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return HFTokenizer(work)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--n", type=int, default=4, help="samples per request")
    p.add_argument("--tokens", type=int, default=96, help="max_tokens of every sample")
    p.add_argument("--vocab", type=int, default=2000, help="the trained tokenizer's size")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    tok = tokenizer(args.vocab, Path(tempfile.mkdtemp(prefix="jaxrl-constrained-")))
    cfg = ModelConfig(vocab_size=tok.vocab_size, embed_dim=128, num_layers=4, num_heads=4,
                      num_kv_heads=2, head_dim=32, mlp_dim=384, max_seq_len=256)
    engine = Engine(cfg, EngineConfig(max_concurrent_decodes=args.requests * args.n,
                                      max_len=128, max_prefill_length=32, prefill_chunk=32))
    grammars = Grammars(tok, cfg.vocab_size)
    grammar = json_schema_grammar(SCHEMA)
    prompts = [tok.encode(f'{{"city": "town{i}"')[:8] for i in range(args.requests)]
    free = SamplingParams(temperature=1.0, max_tokens=args.tokens, n=args.n, stop_at_eos=False)
    constrained = SamplingParams(temperature=1.0, max_tokens=args.tokens, n=args.n,
                                 grammar=grammar)
    with Orchestrator(engine, split_params(Transformer(cfg, rngs=nnx.Rngs(0)))[1],
                      eos_id=tok.eos_id, grammars=grammars) as o:
        def run(sampling):
            t0 = time.perf_counter()
            streams = [o.submit(prompt, sampling) for prompt in prompts]
            samples = [s for stream in streams for s in stream.result()]
            return time.perf_counter() - t0, samples

        run(free), run(constrained)                 # every program and the tokenizer, once
        per_token = {"free": [], "constrained": []}
        parsed = lengths = 0
        for _ in range(args.rounds):
            for name, sampling in (("free", free), ("constrained", constrained)):
                seconds, samples = run(sampling)
                tokens = sum(len(s.tokens) for s in samples)
                per_token[name].append(seconds / tokens)
                if name == "constrained":
                    lengths += tokens / len(samples)
                    parsed += sum(_parses(tok.decode(s.tokens)) for s in samples)
        matcher = grammars.matcher(grammar)
        t0, masks = time.perf_counter(), 200
        for _ in range(masks):
            grammars.fill([matcher], 1)
        mask_s = (time.perf_counter() - t0) / masks
    free_ms = 1e3 * statistics.median(per_token["free"])
    con_ms = 1e3 * statistics.median(per_token["constrained"])
    samples = args.rounds * args.requests * args.n
    print(f"free:        {free_ms:.3f} ms per token")
    print(f"constrained: {con_ms:.3f} ms per token ({con_ms / free_ms:.2f}x), samples of "
          f"{lengths / args.rounds:.1f} tokens on average, {parsed} of {samples} parse")
    print(f"one row's mask (llguidance, host): {1e3 * mask_s:.3f} ms at vocab {cfg.vocab_size}")
    print(json.dumps({"free_ms_per_token": free_ms, "constrained_ms_per_token": con_ms,
                      "ratio": con_ms / free_ms, "parsed": parsed, "samples": samples,
                      "mask_ms_per_row": 1e3 * mask_s, "vocab": cfg.vocab_size}))


def _parses(text: str) -> bool:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(obj, dict) and set(obj) == set(SCHEMA["properties"])


if __name__ == "__main__":
    main()
