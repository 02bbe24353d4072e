"""Incremental detokenization (serving/frontends/detokenize.py) against the one-shot decode of the
whole sequence, on a byte-level BPE tokenizer (multi-byte characters split across tokens) and a
SentencePiece-style one (leading-space markers), for 8k-token outputs."""

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxrl.models.tokenizer import HFTokenizer
from serving.frontends.detokenize import IncrementalDecoder
from serving.frontends.openai_choices import Choice

TEXT = ("Grüße aus Köln — naïve café, 日本語のテキスト, 中文字符, emoji 🙂🚀🧪, Ελληνικά, русский "
        "текст, and plain ASCII words with numbers 12345. ")


def _byte_level(tmp_path):
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT] * 50, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    return HFTokenizer(tmp_path)


def _metaspace(tmp_path):
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator([TEXT] * 50, trainers.BpeTrainer(vocab_size=400,
                                                             special_tokens=["<unk>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    return HFTokenizer(tmp_path)


class Counting:
    """A tokenizer that records how many tokens each decode call was given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.sizes = tokenizer, []

    def decode(self, ids):
        self.sizes.append(len(ids))
        return self.tokenizer.decode(ids)


def _sequences(tokenizer, rng):
    text_ids = tokenizer.encode(TEXT * 1000)[:8192]
    random_ids = rng.integers(0, tokenizer.vocab_size, 8192).tolist()   # broken bytes too
    return {"text": text_ids, "random": random_ids}


@pytest.mark.parametrize("kind", ["byte_level", "metaspace"])
def test_streamed_text_equals_the_one_shot_decode_at_a_constant_cost(tmp_path, kind):
    tokenizer = (_byte_level if kind == "byte_level" else _metaspace)(tmp_path)
    for name, ids in _sequences(tokenizer, np.random.default_rng(0)).items():
        assert len(ids) == 8192
        counting = Counting(tokenizer)
        decoder = IncrementalDecoder(counting)
        pieces = [decoder.add(t) for t in ids]
        streamed = "".join(pieces) + decoder.flush()
        assert streamed == tokenizer.decode(ids), name
        if name == "text":
            assert any("\ufffd" not in p and len(p.encode()) > len(p) for p in pieces)
            assert "\ufffd" not in "".join(pieces)        # no half character was ever sent
        # Each call decodes a short window, never the sequence so far.
        assert max(counting.sizes) <= 32, (name, max(counting.sizes))


def test_openai_choice_streams_the_same_text_and_cuts_at_a_stop_string(tmp_path):
    tokenizer = _byte_level(tmp_path)
    ids = tokenizer.encode(TEXT * 60)
    whole = tokenizer.decode(ids)
    streamed = Choice(tokenizer, stops=["🚀🧪"])
    plain = Choice(tokenizer, stops=["🚀🧪"])
    sent = []
    for t in ids:
        streamed.add(t, 0.0)
        plain.add(t, 0.0)
        sent.append(streamed.delta(final=False))
        if streamed.finish:
            break
    sent.append(streamed.delta(final=True))
    cut = whole.index("🚀🧪")
    assert "".join(sent) == whole[:cut] == streamed.text == plain.text
    assert streamed.finish == plain.finish == "stop"

    long = Choice(tokenizer, stops=["never there"])
    for t in ids:
        long.add(t, 0.0)
    long.end("length")
    assert long.text == whole and long.finish == "length"
