"""Tiny Hugging Face model folders for end-to-end tests, written with `transformers`."""

import json
from pathlib import Path

import torch
import transformers
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]   # Qwen2.5-Instruct's, same roles
# Qwen2.5's chat template, cut to what plain messages need.
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


def tiny_qwen(path: Path, texts: list[str]) -> None:
    """A Hugging Face folder as Qwen2.5-Instruct's is laid out: a random 2-layer Qwen2 and a
    word-level tokenizer over `texts`, with Qwen's chat tokens as special tokens and
    <|im_end|> as eos_token."""
    split = pre_tokenizers.Whitespace()
    words = sorted({w for t in texts for w, _ in split.pre_tokenize_str(t)} - set(SPECIALS))
    vocab = {w: i for i, w in enumerate(["<unk>"] + SPECIALS + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = split
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
         "chat_template": CHAT_TEMPLATE}))
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=vocab["<|endoftext|>"],
        eos_token_id=vocab["<|im_end|>"])
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)


def tiny_qwen_bpe(path: Path, texts: list[str], layers: int = 2) -> None:
    """`tiny_qwen` with a byte-level BPE tokenizer learnt from `texts`: the tokenizer
    `transformers` itself builds for a Qwen2 folder (Qwen2Tokenizer, from the vocabulary and
    merges) reads it, as clients that load the folder with AutoTokenizer do (the tinker SDK);
    it encodes any text. Weights drawn 10x wider than Qwen's init, so that a LoRA on the
    layers can move the logits (behind a 0.02-wide tied head it can hardly)."""
    from tokenizers import decoders, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path / "tokenizer.json"))
    vocab = tok.get_vocab()
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
         "chat_template": CHAT_TEMPLATE}))
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, initializer_range=0.2, bos_token_id=vocab["<|endoftext|>"],
        eos_token_id=vocab["<|im_end|>"])
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
