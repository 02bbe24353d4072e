"""The real `lm_eval` command (lm-evaluation-harness, `--model local-completions`) against
`jaxrl serve --http-port --score`, on two local tasks, one of each kind: multiple choice
(loglikelihood requests: echo, prompt log-probs) and generate_until. Every per-sample answer and
both scores are checked against a direct computation with Hugging Face `transformers` on the
same folder."""

import json
import subprocess
import sys

import numpy as np
import openai
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from tests.test_serve import _jaxrl_serve
import pytest

pytestmark = pytest.mark.slow

VOCAB = 48
WORDS = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)]
TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files: {data}
test_split: train
doc_to_text: "{{{{question}}}}"
"""
MULTIPLE_CHOICE = """output_type: multiple_choice
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
"""
GENERATE = """output_type: generate_until
doc_to_target: "{{target}}"
generation_kwargs:
  until: ["</s>"]
  max_gen_toks: 5
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
"""


def hf_folder(path):
    """A random Llama and a word-level tokenizer that adds no special tokens, so the ids lm-eval
    sends are the words' own."""
    torch.manual_seed(3)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=128,
                                      initializer_range=0.5)
    hf = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    hf.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>",
         "unk_token": "<unk>"}))
    return hf


def ids(text: str) -> list[int]:
    return [WORDS.index(w) for w in text.split()]


def words(rng, n: int) -> str:
    return " ".join(f"w{i}" for i in rng.integers(0, VOCAB - 3, n))


def tasks(path, rng):
    mc = [{"question": words(rng, int(rng.integers(2, 7))),
           "choices": [words(rng, int(rng.integers(1, 4))) for _ in range(4)],
           "answer": int(rng.integers(4))} for _ in range(10)]
    gen = [{"question": words(rng, int(rng.integers(2, 7))), "target": words(rng, 2)}
           for _ in range(5)]
    for name, docs, kind in (("jaxrl_mc", mc, MULTIPLE_CHOICE), ("jaxrl_gen", gen, GENERATE)):
        data = path / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (path / f"{name}.yaml").write_text(TASK.format(name=name, data=data) + kind)
    return mc, gen


def samples(out, task: str) -> list[dict]:
    (path,) = out.rglob(f"samples_{task}_*.jsonl")
    return sorted((json.loads(line) for line in path.read_text().splitlines()),
                  key=lambda s: s["doc_id"])


def test_lm_eval_local_completions_scores_equal_a_direct_computation(tmp_path):
    model_dir, task_dir, out = tmp_path / "model", tmp_path / "tasks", tmp_path / "out"
    for d in (model_dir, task_dir):
        d.mkdir()
    hf = hf_folder(model_dir)
    mc, gen = tasks(task_dir, np.random.default_rng(0))

    # No --max-prefill-length: prompts up to --max-len less one token, by default.
    with _jaxrl_serve(model_dir, "--http-port", "0", "--score", "--max-len", "64",
                      "--slots", "4") as (_, _, output):
        line = next(x for x in output if "OpenAI-compatible API on" in x)
        base = line.split(" on ")[1].split()[0]
        long_prompt = ids(words(np.random.default_rng(1), 62))
        client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
        echoed = client.completions.create(model="model", prompt=long_prompt, max_tokens=1,
                                           temperature=0, echo=True, logprobs=1).choices[0]
        assert len(echoed.logprobs.tokens) == 63
        done = subprocess.run(
            [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
             f"base_url={base}/completions,model=model,tokenizer={model_dir},"
             "tokenizer_backend=huggingface,tokenized_requests=True,max_retries=1",
             "--tasks", "jaxrl_mc,jaxrl_gen", "--include_path", str(task_dir),
             "--output_path", str(out), "--log_samples"],
            capture_output=True, text=True, timeout=600, env={
                **__import__("os").environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (results,) = out.rglob("results_*.json")
    scores = json.loads(results.read_text())["results"]

    with torch.no_grad():
        def logp(tokens):
            return torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), -1).numpy()

        # Multiple choice: each option's loglikelihood and whether it is the greedy one.
        right = []
        for doc, sample in zip(mc, samples(out, "jaxrl_mc")):
            context = ids(doc["question"])
            want = []
            for choice, (got, greedy) in zip(doc["choices"], sample["filtered_resps"]):
                tokens = context + ids(choice)
                lp = logp(tokens)
                rows = np.arange(len(context) - 1, len(tokens) - 1)
                want.append(lp[rows, tokens[len(context):]].sum())
                assert abs(float(got) - want[-1]) < 1e-4, (doc, choice)
                assert (greedy == "True") == bool(
                    (lp[rows].argmax(-1) == tokens[len(context):]).all())
            right.append(int(np.argmax(want)) == doc["answer"])
        assert abs(scores["jaxrl_mc"]["acc,none"] - np.mean(right)) < 1e-9

        # generate_until: the greedy continuation, cut at </s>.
        matches = []
        for doc, sample in zip(gen, samples(out, "jaxrl_gen")):
            prompt = ids(doc["question"])
            tokens = hf.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
            text = " ".join(WORDS[t] for t in tokens).split("</s>")[0].strip()
            assert sample["filtered_resps"][0].strip() == text, (doc, tokens)
            matches.append(text == doc["target"])
        assert abs(scores["jaxrl_gen"]["exact_match,none"] - np.mean(matches)) < 1e-9
