"""Serving engine: decode tokens/s against HF `generate`, update pause against a reload.

Decode throughput against Hugging Face `generate`, and the in-flight weight update pause against
stopping and reloading from a checkpoint. Both sides run in this process on the same model,
batch and lengths; the script prints measured ratios.

    jaxrl bench engine [--batch 8] [--prompt 16] [--new 64]
    (or: .venv/bin/python bench/engine.py ...)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from jaxrl.models import from_hf, split_params  # noqa: E402
from serving.core.orchestrator import Orchestrator  # noqa: E402
from serving.runner.engine import Engine, EngineConfig, SlotBatch  # noqa: E402
from serving.runner.sampling import SamplingParams  # noqa: E402


def hf_model(path, args):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.embed, intermediate_size=3 * args.embed,
        num_hidden_layers=args.layers, num_attention_heads=args.embed // 32,
        num_key_value_heads=args.embed // 64, max_position_embeddings=256)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(path)
    return model


def best_of(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--batch", type=int, default=8, help="requests decoded together (slots)")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens per request")
    ap.add_argument("--new", type=int, default=64, help="generated tokens per request")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs of each side; best kept")
    # The default model is the demo's shape (configs/demo_cpu.yaml) with a 1024-token vocabulary.
    ap.add_argument("--embed", type=int, default=128,
                    help="model width, a multiple of 64 (32-wide heads)")
    ap.add_argument("--layers", type=int, default=4, help="transformer layers")
    ap.add_argument("--vocab", type=int, default=1024, help="vocabulary size")
    args = ap.parse_args(argv)
    torch.set_num_threads(os.cpu_count())
    tmp = tempfile.mkdtemp()
    ref = hf_model(tmp, args)
    model = from_hf(tmp)
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, args.vocab, size=(args.batch, args.prompt))
    tokens = args.batch * args.new

    # Hugging Face generate, greedy, with its KV cache.
    ids = torch.from_numpy(prompts).long()

    def run_hf():
        with torch.no_grad():
            ref.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new,
                         do_sample=False, pad_token_id=0)

    run_hf()

    # The engine: continuous batching, every request in its own slot.
    engine = Engine(model.cfg, EngineConfig(
        max_concurrent_decodes=args.batch, max_len=args.prompt + args.new + 8,
        max_prefill_length=args.prompt, prefill_chunk=args.prompt, min_bucket=args.prompt))
    params = split_params(model)[1]
    placed = engine.prepare_params(params)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.new, stop_at_eos=False)
    # The bare decode step, no orchestration: what the device needs per step for every slot,
    # each slot on pages of its own as wide as its longest sequence.
    state = engine.init_decode_state()
    width = engine.cfg.pages_per_sequence
    table = 1 + np.arange(args.batch * width, dtype=np.int32).reshape(args.batch, width)

    def steps():
        nonlocal state
        for _ in range(100):
            state, _, _ = engine.generate(placed, state, table)
        jax.block_until_ready(state)

    steps()
    step_s = best_of(steps, 5)[0] / 100
    del state

    with Orchestrator(engine, params) as o:
        def run_engine():
            streams = [o.submit(p.tolist(), greedy) for p in prompts]
            for s in streams:
                assert len(s.result()[0].tokens) == args.new

        run_engine()
        # Alternate the two so that a noisy neighbour on the machine hits both alike.
        hf_times, engine_times = [], []
        for _ in range(args.repeats):
            hf_times.append(best_of(run_hf, 1)[0])
            engine_times.append(best_of(run_engine, 1)[0])
        hf_s, engine_s = min(hf_times), min(engine_times)

        # In-flight update while every slot is decoding: the pause is the time the decode
        # loop is held; the transfer happens beside it.
        new_params = jax.tree.map(lambda x: x * 1.01, params)
        pauses, transfers = [], []
        for k in range(5):
            streams = [o.submit(p.tolist(), greedy) for p in prompts]
            time.sleep(0.05)
            r = o.update_params(new_params if k % 2 == 0 else params, k + 1)
            pauses.append(r.pause_s)
            transfers.append(r.transfer_s)
            for s in streams:
                s.result()

    # The conventional alternative: stop serving, save the new weights with Orbax, restore them
    # into a fresh engine (its programs already compiled), re-prefill what was in flight.
    ckpt = ocp.StandardCheckpointer()

    def reload():
        path = os.path.join(tempfile.mkdtemp(), "w")
        ckpt.save(path, new_params)
        ckpt.wait_until_finished()
        restored = ckpt.restore(path, jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), new_params))
        restored = engine.prepare_params(restored)
        state = engine.init_decode_state()
        rows = engine.cfg.prefill_rows(engine.bucket(args.prompt))
        for lo in range(0, args.batch, rows):
            slots = list(range(lo, min(lo + rows, args.batch)))
            n = len(slots)
            state, logits = engine.prefill(restored, state, prompts[slots], [0] * n,
                                           [args.prompt] * n, table[slots])
            first, _ = engine.sample_first(logits, list(range(n)), [greedy] * n, [0] * n)
            state = engine.insert(state, SlotBatch(slots, [args.prompt] * n, first, [1] * n,
                                                     [greedy] * n, [0] * n))
        jax.block_until_ready(state)

    reload()
    reload_s, _ = best_of(reload, args.repeats)

    rows = {
        "engine_tokens_per_s": tokens / engine_s,
        "hf_generate_tokens_per_s": tokens / hf_s,
        "engine_vs_hf": hf_s / engine_s,
        "engine_decode_step_ms": 1e3 * step_s,
        "hf_ms_per_step": 1e3 * hf_s / args.new,
        "update_pause_ms_median": 1e3 * statistics.median(pauses),
        "update_pause_ms_max": 1e3 * max(pauses),
        "update_transfer_ms_median": 1e3 * statistics.median(transfers),
        "stop_and_reload_ms": 1e3 * reload_s,
        "reload_vs_pause": reload_s / statistics.median(pauses),
    }
    print(f"model: Llama-style, {model.cfg.num_params() / 1e6:.1f}M params, float32; batch "
          f"{args.batch}, prompt {args.prompt}, {args.new} new tokens, {jax.devices()[0].platform}")
    for k, v in rows.items():
        print(f"  {k:28s} {v:12.3f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
