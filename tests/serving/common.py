"""Shared by the serving tests: a tiny model config, an engine config, prompts."""

import contextlib
import threading
from concurrent import futures
from functools import partial

import grpc
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.models import ModelConfig, merge_params
from jaxrl.models.kv_cache import ContiguousKV
from serving.proto import generation_pb2_grpc as gen_grpc
from serving.runner.engine import EngineConfig
from serving.runner.sampling import Draws, sample, slot_keys

CFG = ModelConfig(vocab_size=32, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, mlp_dim=64, qkv_bias=True)
# Pages of 4 tokens: a 64-token sequence spans 16 of them, and the pool's 64 (plus the null
# page) are reused many times over a test session. Power-of-two table widths only, so that
# few programs are compiled (the pool-exhaustion test uses 4 widths per doubling).
ENGINE = EngineConfig(max_concurrent_decodes=4, max_len=64, max_prefill_length=40,
                      prefill_chunk=16, min_bucket=4, page_size=4, page_buckets=1)


def until(predicate, timeout: float = 60.0, what: str = "the condition") -> None:
    """Returns once `predicate()` holds; fails the test naming `what` after `timeout` s."""
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        time.sleep(0.005)


def held_turns(orchestrator, turns: int = 3) -> None:
    """Returns once a paused engine's loop has turned `turns` more times (each a turn that ran
    nothing): whatever was queued before this call has been seen by the loop, so nothing
    generated for it proves the pause held, without waiting an arbitrary time."""
    start = orchestrator.metrics()["held_iterations"]
    until(lambda: orchestrator.metrics()["held_iterations"] >= start + turns,
          what=f"{turns} turns of the paused engine loop")


def run_staggered(orchestrator, requests):
    """Submits `requests` ((prompt, sampling) pairs) from threads spread over the decode steps
    of earlier ones (a pause of 0-40 ms between arrivals spreads them; the results do not
    depend on it). Returns each request's samples."""
    import time

    results = [None] * len(requests)

    def run(i):
        results[i] = orchestrator.submit(*requests[i]).result()

    threads = []
    for i in range(len(requests)):
        threads.append(threading.Thread(target=run, args=(i,)))
        threads[-1].start()
        time.sleep(0.02 * (i % 3))
    for t in threads:
        t.join(300)
        assert not t.is_alive(), "a request did not finish within 300 s"
    return results


def prompts(*lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, CFG.vocab_size, n).tolist() for n in lengths]


@partial(jax.jit, static_argnums=0)
def _contiguous_step(graphdef, params, token, position, cache, sampling_args):
    """One token through the contiguous cache and the engine's sampler (its key made here:
    `sampling_args` carries the seed, sample index and count it is made from)."""
    temperature, top_k, top_p, seed, index, count, banned = sampling_args
    model = merge_params(graphdef, params)
    x, cache = model.extend(jnp.reshape(token, (1, 1)), jnp.reshape(position, (1,)), cache)
    keys = slot_keys(seed, index, count)
    return sample(model.logits(x)[:, 0], Draws(temperature, top_k, top_p, keys), banned), cache


def contiguous_decode(graphdef, params, prompt, sampling, index, versions, eos_id=None):
    """The independent reference for the paged engine: one sequence fed a token at a time into
    a contiguous KV cache (jaxrl.models.kv_cache), token j drawn under params[versions[j]] with
    the engine's sampler and keys (EOS banned for j < sampling.min_tokens). Returns (tokens,
    logprobs)."""
    cache = ContiguousKV.zeros(CFG.num_layers, 1, ENGINE.max_len, CFG.num_kv_heads, CFG.head_dim)
    args = lambda j: (np.asarray([sampling.temperature], np.float32),  # noqa: E731
                      np.asarray([sampling.top_k], np.int32),
                      np.asarray([sampling.top_p], np.float32),
                      np.asarray([sampling.seed], np.uint32), np.asarray([index], np.int32),
                      np.asarray([j], np.int32),
                      np.asarray([eos_id if j < sampling.min_tokens and eos_id is not None
                                  else -1], np.int32))
    fed = list(prompt)
    tokens, logprobs = [], []
    for position in range(len(prompt) + len(versions) - 1):
        # The token fed at `position` is written by the weights of the token it leads to.
        j = max(position - len(prompt) + 1, 0)
        (token, logprob), cache = _contiguous_step(graphdef, params[versions[j]],
                                                   np.int32(fed[position]), np.int32(position),
                                                   cache, args(j))
        if position >= len(prompt) - 1:
            tokens.append(int(token[0]))
            logprobs.append(float(logprob[0]))
            fed.append(tokens[-1])
    return tokens, logprobs


class _Hung(gen_grpc.GenerationServicer):
    """Accepts every call and never answers (until released)."""

    def __init__(self):
        self.release = threading.Event()

    def UpdateWeights(self, request_iterator, context):
        self.release.wait(60)

    def GetMetrics(self, request, context):
        self.release.wait(60)

    def Generate(self, request, context):
        self.release.wait(60)
        return iter(())


@contextlib.contextmanager
def hung_generation_server():
    """The address of a gRPC server that accepts Generation calls and never answers them."""
    servicer = _Hung()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    gen_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        servicer.release.set()
        server.stop(0)


def byte_bpe_tokenizer(path, texts, vocab_size: int = 320):
    """A byte-level BPE tokenizer folder (tokenizer.json, its EOS `<eos>` in
    tokenizer_config.json) trained on `texts`, as a model folder holds one; its HFTokenizer."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from jaxrl.models.tokenizer import HFTokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return HFTokenizer(path)
