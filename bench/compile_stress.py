"""Stress: the conditions of the suite's old XLA:CPU crashes, for --minutes or until it crashes.

The crashes (docs/testing.md, "Time and crashes") came in long-lived processes that compiled on one
thread while other threads executed, with engines created and dropped and the persistent
compilation cache on. This script does exactly that, in a loop: a serving engine decodes a
stream of requests on its loop thread, a train-step-like program executes on another thread,
and the main thread builds engines of ever new shapes (each compiling all of its programs, with
the cache on, into a fresh directory), serves a request on each, and drops them. It prints one
line per round; its last line is JSON with the rounds, programs compiled and seconds run. A
crash ends the process (the exit status says how), which is the finding.

    jaxrl bench compile_stress --minutes 10
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import threading
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jaxrl.models import ModelConfig, Transformer, split_params  # noqa: E402
from serving.core.orchestrator import Orchestrator  # noqa: E402
from serving.runner.engine import Engine, EngineConfig  # noqa: E402
from serving.runner.sampling import SamplingParams  # noqa: E402

CFG = ModelConfig(vocab_size=64, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, mlp_dim=128, max_seq_len=256)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    args = p.parse_args()
    cache = tempfile.mkdtemp(prefix="jaxrl-stress-cache-")
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    params = split_params(Transformer(CFG, rngs=nnx.Rngs(0)))[1]
    stop = threading.Event()

    def train_like():       # executes (and now and then compiles) beside everything else
        x, i = jnp.ones((256, 256)), 0
        while not stop.is_set():
            i += 1
            f = jax.jit(lambda a, k=i % 7: jnp.tanh(a @ a.T) * k)
            x = f(x / 256).block_until_ready()

    background = Orchestrator(Engine(CFG, EngineConfig(max_concurrent_decodes=8, max_len=128)),
                              params).start()

    def decode_forever():
        while not stop.is_set():
            background.submit([3, 4, 5], SamplingParams(max_tokens=100, n=4)).result()

    threads = [threading.Thread(target=train_like, daemon=True),
               threading.Thread(target=decode_forever, daemon=True)]
    for t in threads:
        t.start()
    start, rounds, programs = time.monotonic(), 0, 0
    while time.monotonic() - start < 60 * args.minutes:
        rounds += 1
        cfg = EngineConfig(max_concurrent_decodes=4 + rounds % 5,    # a new shape each round
                           max_len=64 + 8 * (rounds // 5 % 24),
                           max_prefill_length=32, prefill_chunk=16)
        engine = Engine(CFG, cfg)
        with Orchestrator(engine, params) as o:
            programs += o.compiled_at_start
            o.submit([5, 6, 7, 8], SamplingParams(max_tokens=20, n=2)).result()
        del engine, o
        gc.collect()
        maps = sum(1 for _ in open("/proc/self/maps"))
        print(f"round {rounds}: {programs} programs compiled, {maps} memory maps, "
              f"{time.monotonic() - start:.0f} s", flush=True)
    stop.set()
    for t in threads:
        t.join(60)
    background.stop()
    print(json.dumps({"rounds": rounds, "programs": programs,
                      "seconds": round(time.monotonic() - start, 1), "crashed": False}))


if __name__ == "__main__":
    main()
