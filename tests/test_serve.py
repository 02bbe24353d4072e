"""`jaxrl serve --model HF_DIR` loads a Hugging Face folder with its tokenizer and generates as
Hugging Face does."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request

import grpc
import jax
import numpy as np
import openai
import pytest
import torch
import transformers
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer, models, pre_tokenizers

from jaxrl.commands.serve import load_model
from jaxrl.models import split_params
from jaxrl.models.generate import greedy_generate
from jaxrl.models.tokenizer import HFTokenizer
from serving.core.orchestrator import Orchestrator
from serving.proto import generation_pb2 as gen
from serving.proto import generation_pb2_grpc as gen_grpc
from serving.runner.engine import Engine, EngineConfig
from serving.runner.sampling import SamplingParams
from tests.xla import xla_flags

pytestmark = pytest.mark.slow


def _word_tokenizer(path, vocab_size):
    """A word-level tokenizer.json of `vocab_size` ids: <unk>, <s>, </s>, w0, w1, ..."""
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(vocab_size - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))


_TINY_QWEN2 = transformers.Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, tie_word_embeddings=True)


def _tiny_qwen2(path):
    """A random tiny Qwen2 folder (seed 0) with a 40-word tokenizer at `path`."""
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(_TINY_QWEN2).save_pretrained(path)
    _word_tokenizer(path, 40)


def test_serves_a_hugging_face_folder(tmp_path):
    _tiny_qwen2(tmp_path)

    model, tokenizer, what = load_model(str(tmp_path), "unused", print)
    assert what == f"qwen2 from {tmp_path}" and tokenizer.eos_id == 2
    engine = Engine(model.cfg, EngineConfig(max_concurrent_decodes=2, max_len=32,
                                            max_prefill_length=16, prefill_chunk=8))
    prompt = tokenizer.encode("w3 w7 w1 w30")
    with Orchestrator(engine, split_params(model)[1]) as o:
        out = o.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6))[0].tokens
    assert out == greedy_generate(model, [prompt], 6, eos_id=-1)[0]
    assert np.all(np.asarray(out) < 40)


def test_serves_a_peft_adapter_trained_elsewhere_merged_into_its_base(tmp_path):
    """`jaxrl serve --model BASE --lora ADAPTER`: an adapter made by the `peft` package itself
    (random A and B on q, v and down projections) is merged into the base; the served model's
    logits are PEFT's on transformers."""
    import peft
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(_TINY_QWEN2)
    base.save_pretrained(tmp_path / "base")
    _word_tokenizer(tmp_path / "base", 40)
    adapted = peft.get_peft_model(base, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn_like(p))
    adapted.save_pretrained(tmp_path / "adapter")
    ids = np.array([[3, 7, 1, 30, 12, 5]])
    with torch.no_grad():
        want = adapted.eval()(torch.from_numpy(ids)).logits.numpy()
    model, _, what = load_model(str(tmp_path / "base"), "unused", print,
                                lora_dir=str(tmp_path / "adapter"))
    assert what.endswith(f"with the LoRA adapter in {tmp_path / 'adapter'} merged")
    np.testing.assert_allclose(np.asarray(model(ids)), want, rtol=1e-4, atol=1e-5)


def test_a_server_holding_adapters_takes_a_trainers_adapters_alone(tmp_path, caplog):
    """`jaxrl serve --lora-rank` (load_model's `adapters`): the base loads with zero adapters
    beside it (it serves as the base), takes a trainer's first push of every weight and then
    its adapters alone over gRPC, and decodes as the trainer's model each time; the server
    logs the adapter updates as such. A server without adapters refuses an adapter tree,
    saying which flags would hold them."""
    from jaxrl.commands.serve import hold_adapters
    from jaxrl.errors import UserError
    from jaxrl.models import lora, merge_params
    from jaxrl.models.lora import LoraConfig
    from serving.fleet.client import RemoteGeneration
    from serving.frontends.server import Server
    from sharding.reshard import WeightUpdateError

    _tiny_qwen2(tmp_path)
    shape = LoraConfig(rank=4, alpha=8, targets=("q_proj", "down_proj"))
    base, tokenizer, _ = load_model(str(tmp_path), "unused", print)
    model, _, what = load_model(str(tmp_path), "unused", print, adapters=shape)
    assert what.endswith("holding LoRA adapters of rank 4 on q_proj,down_proj")
    graphdef, held = split_params(model)
    assert sorted(lora.trainable(held)["layers"]) == [
        "down_proj_lora_a", "down_proj_lora_b", "q_proj_lora_a", "q_proj_lora_b"]
    ids = np.array([[3, 7, 1, 30, 12, 5]])
    np.testing.assert_array_equal(np.asarray(model(ids)), np.asarray(base(ids)))
    assert hold_adapters(model, shape) is model            # already held: kept
    with pytest.raises(UserError, match=r"--lora-rank 8 .* holds adapters of rank 4"):
        hold_adapters(model, LoraConfig(rank=8))
    with pytest.raises(UserError, match=r"--lora .* and --lora-rank 4 .* give one of them"):
        load_model(str(tmp_path), "unused", print, lora_dir=str(tmp_path), adapters=shape)

    def trainers(seed):     # the trainer's model: the base with adapters it trained
        keys = iter(jax.random.split(jax.random.key(seed), 8))
        return lora.with_trainable(held, {"layers": {
            k: jax.random.normal(next(keys), v.shape) * 0.5
            for k, v in lora.trainable(held)["layers"].items()}})

    prompt = tokenizer.encode("w3 w7 w1 w30")
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    engine = Engine(model.cfg, EngineConfig(max_concurrent_decodes=2, max_len=32,
                                            max_prefill_length=16, prefill_chunk=8))
    plain = Engine(base.cfg, engine.cfg)
    server = Server(Orchestrator(engine, held).start(), port=0, update_token="t").start()
    other = Server(Orchestrator(plain, split_params(base)[1]).start(), port=0,
                   update_token="t").start()
    remote = RemoteGeneration(server.address, token="t")
    caplog.set_level("INFO", logger="jaxrl")
    try:
        first, second = trainers(1), trainers(2)
        remote.update_params(first, 1, timeout=60)
        assert remote.submit(prompt, greedy).result()[0].tokens == greedy_generate(
            merge_params(graphdef, first), [prompt], 6, eos_id=-1)[0]
        result = remote.update_params(lora.trainable(second), 2, timeout=60)
        assert remote.submit(prompt, greedy).result()[0].tokens == greedy_generate(
            merge_params(graphdef, second), [prompt], 6, eos_id=-1)[0]
        assert result.version == 2
        assert [r.getMessage().split(":")[0] for r in caplog.records
                if "weights version" in r.getMessage()] == [
            "weights version 1 streamed", "weights version 2 streamed (LoRA adapters alone)"]
        with pytest.raises(WeightUpdateError, match=r"'layers/down_proj_lora_a' is not a "
                                                    r"parameter .* --lora-rank, --lora-alpha"):
            RemoteGeneration(other.address, token="t").update_params(second, 1, timeout=60)
    finally:
        remote.close()
        server.stop(grace=0)
        other.stop(grace=0)


@pytest.mark.slow
def test_a_thousand_tokens_through_jaxrl_serve_equal_transformers_generate(tmp_path):
    """`jaxrl serve --model HF_DIR` (a real server process, paged KV cache, pages of 16 tokens
    taken as the sequence grows) decodes 1,000 tokens greedily exactly as Hugging Face's
    `generate` does (float32, tiny random Llama with a 1,100-token context)."""
    torch.manual_seed(0)
    # Weights drawn wider than the usual 0.02, so that the next token is rarely a near tie.
    config = transformers.LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=1100,
                                      initializer_range=0.3)
    hf = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    hf.save_pretrained(tmp_path)
    _word_tokenizer(tmp_path, 40)
    prompt = [1, 17, 5, 30, 22, 9, 11, 3]
    hf.generation_config.eos_token_id = None   # run to the limit, EOS included, as ignore_eos
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=1000,
                           do_sample=False)[0, len(prompt):].tolist()

    with _jaxrl_serve(tmp_path, "--slots", "2", "--max-prefill-length", "16",
                      "--page-size", "16") as (line, address, _):
        assert "max_len 1100" in line, line
        with grpc.insecure_channel(address) as channel:
            out = list(gen_grpc.GenerationStub(channel).Generate(gen.GenerateRequest(
                token_ids=gen.TokenIds(ids=prompt),
                sampling=gen.SamplingOptions(max_tokens=1000, temperature=0.0, ignore_eos=True)),
                timeout=300))
    got = [r.token_ids[0] for r in out if r.token_ids]
    assert out[-1].finish_reason == "length"
    assert got == want


@contextlib.contextmanager
def _jaxrl_serve(folder, *flags, devices=None):
    """A `jaxrl serve --model folder` subprocess, ready: (its ready line, its address, every
    line it printed up to then). Stopped with SIGTERM afterwards."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if devices:
        env["XLA_FLAGS"] = xla_flags(devices)
    proc = subprocess.Popen([sys.executable, "-m", "jaxrl.cli", "serve", "--model", str(folder),
                             "--port", "0", *flags], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    try:
        output = []
        for line in proc.stdout:
            output.append(line)
            if "ready on" in line:
                break
        else:
            raise AssertionError("jaxrl serve did not start:\n" + "".join(output)[-3000:])
        threading.Thread(target=proc.stdout.read, daemon=True).start()   # keep it drained
        yield line, line.split("ready on ")[1].split(": ")[0], output
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        finally:
            proc.kill()


@pytest.mark.slow
def test_serve_on_a_mesh_equals_transformers_generate(tmp_path):
    """`jaxrl serve --tensor 2 --replicas 2 --http-port 0` on 4 CPU devices: the Hugging Face
    folder is loaded straight onto replica 0's mesh, groups spread over both replicas, and every
    greedy output equals Hugging Face's `generate`, through gRPC and through the OpenAI API;
    gRPC's health check says SERVING and the Prometheus scrape counts every request."""
    torch.manual_seed(1)
    config = transformers.LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=128,
                                      initializer_range=0.3)
    hf = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    hf.generation_config.eos_token_id = None
    hf.save_pretrained(tmp_path)
    _word_tokenizer(tmp_path, 40)
    prompts = [[1, 4 + i, 9, 30 - i, 7] for i in range(6)]
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=40,
                            do_sample=False)[0, len(p):].tolist() for p in prompts]

    with _jaxrl_serve(tmp_path, "--max-prefill-length", "16", "--page-size", "8", "--tensor",
                      "2", "--replicas", "2", "--slots", "2", "--http-port", "0",
                      devices=4) as (line, address, output):
        assert "2 replica(s) x tensor 2; 4 slots" in line, line
        with grpc.insecure_channel(address) as channel:
            stub = gen_grpc.GenerationStub(channel)
            calls = [stub.Generate(gen.GenerateRequest(
                token_ids=gen.TokenIds(ids=p), sampling=gen.SamplingOptions(
                    max_tokens=40, temperature=0.0, ignore_eos=True)), timeout=300)
                for p in prompts]
            got = [[r.token_ids[0] for r in call if r.token_ids] for call in calls]
            metrics = json.loads(stub.GetMetrics(gen.MetricsRequest()).json)
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=30).status
        http = next(x for x in output if "OpenAI-compatible API on" in x)
        client = openai.OpenAI(base_url=http.split(" on ")[1].split()[0], api_key="unused",
                               max_retries=0)
        tokenizer = HFTokenizer(tmp_path)
        for p, w in zip(prompts[:2], want):
            choice = client.completions.create(model=tmp_path.name, prompt=p, max_tokens=40,
                                               temperature=0).choices[0]
            ends = w.index(2) + 1 if 2 in w else len(w)        # the server stops at EOS
            assert choice.text == tokenizer.decode(w[:ends])
            assert choice.finish_reason == ("stop" if 2 in w else "length")
        with urllib.request.urlopen(http.split("metrics on ")[1].strip(), timeout=30) as r:
            scraped = {f.name: f.samples[0].value for f in text_string_to_metric_families(
                r.read().decode())}
    assert got == want
    assert health == health_pb2.HealthCheckResponse.SERVING
    assert scraped["jaxrl_requests_done"] == len(prompts) + 2 and scraped["jaxrl_replicas"] == 2
    assert metrics["replicas"] == 2 and metrics["requests_done"] == len(prompts)
    assert min(metrics["replica_requests_done"]) > 0      # both replicas served


@pytest.mark.multi_device
def test_a_tensor_axis_that_does_not_divide_the_kv_heads_is_refused():
    """The KV cache would be held whole on every device: refused, with the values that work."""
    from jaxrl.commands.serve import check_tensor, serving_meshes
    from jaxrl.errors import UserError
    from jaxrl.models import ModelConfig

    cfg = ModelConfig(num_heads=8, num_kv_heads=2)
    check_tensor(cfg, 2, 8)
    with pytest.raises(UserError, match=r"--tensor 4 does not divide the model's 2 KV heads "
                                        r".* Use --tensor in \[1, 2\] .* --tensor 2 --replicas 4"):
        check_tensor(cfg, 4, 8)
    with pytest.raises(UserError, match="needs 16 devices; this process has 8"):
        serving_meshes(4, 4)
