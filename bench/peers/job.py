"""The job every stack runs in bench/peers.py: one definition, imported by each runner in its
own virtual environment (standard library only).

A GRPO-style job: `prompts_per_step` prompts x `group_size` samples, up to `max_new_tokens` new
tokens at temperature 1.0, one AdamW step per batch, float32, no KL, on a random Llama written to
one Hugging Face folder with a word-level tokenizer. The reward is cheap and the same everywhere,
so the stacks differ only in how they generate and train.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

WORDS = 2000          # the tokenizer's words (plus specials)
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]


@dataclasses.dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int


SIZES = {"3m": Size(256, 4, 4, 2, 688), "30m": Size(576, 8, 8, 4, 1536)}


@dataclasses.dataclass(frozen=True)
class Job:
    size: str = "3m"
    max_new_tokens: int = 64
    prompts_per_step: int = 16
    group_size: int = 8
    steps: int = 10               # optimizer steps; the median is over steps 3..steps
    lr: float = 1e-5
    prompt_words: int = 16        # every prompt is this many words (+ BOS)
    seed: int = 0
    # Samples per forward and backward pass, gradients accumulated into the one optimizer step:
    # jaxrl's (rl.microbatch_rows, whose default this is), TRL's
    # (per_device_train_batch_size with gradient_accumulation_steps; 0: the same as jaxrl's)
    # and Tunix's (train_micro_batch_size, counted in prompts: `tunix_microbatch_prompts`).
    microbatch: int = 16
    trl_microbatch: int = 0

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.group_size

    def __post_init__(self):
        for name in ("microbatch", "trl_microbatch"):
            value = getattr(self, name)
            if value and self.samples_per_step % value:
                raise ValueError(f"{name}={value} must divide the {self.samples_per_step} "
                                 f"samples of a step")

    @property
    def tunix_microbatch_prompts(self) -> int:
        """Tunix's train_micro_batch_size: prompts of `group_size` samples each, so the
        microbatch in prompts where it is a whole number of groups, else the step's."""
        if self.microbatch % self.group_size:
            return self.prompts_per_step
        return self.microbatch // self.group_size

    @property
    def trl_batch(self) -> int:
        """TRL's samples per forward and backward pass."""
        return self.trl_microbatch or self.microbatch

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @staticmethod
    def from_json(text: str) -> "Job":
        return Job(**json.loads(text))


def word(i: int) -> str:
    return f"w{i}"


def reward(completion: str) -> float:
    """The share of words in the completion that are even-numbered words (w0, w2, ...): a dense
    reward a random policy scores about 0.5 on, computed the same way by every stack."""
    words = completion.split()
    if not words:
        return 0.0
    return sum(w[1:].isdigit() and int(w[1:]) % 2 == 0 for w in words) / len(words)


def prompts(job: Job, n: int = 512) -> list[str]:
    rng = random.Random(job.seed)
    return [" ".join(word(rng.randrange(WORDS)) for _ in range(job.prompt_words))
            for _ in range(n)]


def write_model(job: Job, path: Path) -> None:
    """A random Llama (transformers) and its word-level tokenizer, as one HF folder."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIALS + [word(i) for i in range(WORDS)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "pad_token": "<pad>", "unk_token": "<unk>", "model_max_length": 4096}))
    s = SIZES[job.size]
    torch.manual_seed(job.seed)
    config = transformers.LlamaConfig(
        vocab_size=len(vocab), hidden_size=s.hidden, intermediate_size=s.mlp,
        num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
        max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"], pad_token_id=vocab["<pad>"], torch_dtype="float32")
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(path)
    (path / "job_params.txt").write_text(f"{sum(p.numel() for p in model.parameters())}\n")


def result(job: Job, stack: str, steps: list[dict], first_step_s: float, **extra) -> dict:
    """What a runner prints (one JSON line): per-step wall seconds, generation seconds (where
    the stack's step has a generation part), CPU seconds, samples and generated tokens."""
    return {"stack": stack, "job": dataclasses.asdict(job), "steps": steps,
            "first_step_s": first_step_s, **extra}
