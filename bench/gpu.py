"""GPU campaign: train-step MFU, decode against the HBM roofline, update pause, remat, RL modes.

One command, one JSON file, for a ~0.5B and a ~1.5B bfloat16 model (Qwen2.5 shapes, random
weights), each figure against a ceiling measured in the same run:
- peak: bf16 matmul TFLOP/s of a large square matmul; copy: device copy GB/s (read + write);
- train: MFU of the supervised train step at `--tokens` tokens (model FLOPs: 6 x matmul
  parameters x tokens + causal attention, 6 x L x T x N x H per token), with remat=none and
  remat=offload: step time and the compiled program's device temp bytes;
- decode: tokens/s of the engine's decode step at `--slots` slots holding `--held` tokens each,
  against the roofline = slots / (bytes of the weights + the KV held, over the copy bandwidth),
  for each `--decode-attention` (reference, triton, loop; "+fp8": the KV cache in float8);
  and an engine step as the orchestrator runs it, every slot decoding, against the one-step
  decode program at the same held length (bench/_gpu_loop.py);
- update: the in-flight weight swap's decode pause against one device copy of the weights;
- causal: the train step at `--causal-seq` tokens a row with XLA attention dense, XLA attention
  in causal query blocks (jaxrl/models/layers.py, the CPU/TPU default), and cuDNN;
- admit: an RL step's requests (32 x 8 samples of `--admit-tokens` tokens, 6 by default)
  through the orchestrator: the engine loop's host work per request and per decode step,
  against `decode`'s device time;
- rl: async against sync RL steps/s on this one device (colocated), the demo task at the
  0.5B shape;
- long_tail: the long-tail task (answers of 8 to 1,619 tokens) at each model shape, sync,
  partial and async colocated, with bench/simulate.py's prediction beside each
  (bench/_gpu_long_tail.py).

    jaxrl bench gpu --out gpu_campaign.json            (about 8 minutes on one H100)
    jaxrl bench gpu --smoke                            (tiny shapes: the script itself, on CPU)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from _gpu_loop import admit, loop_step
from flax import nnx

from jaxrl.models import ModelConfig, Transformer, abstract_model, layers, split_params
from jaxrl.optim_config import OptimConfig
from jaxrl.train.optim import make_optimizer
from jaxrl.train.state import init_state, state_shardings
from jaxrl.train.step import Layout, jit_train_step
from serving.core.orchestrator import Orchestrator
from serving.runner.engine import Engine, EngineConfig, SlotBatch
from serving.runner.sampling import SamplingParams
from sharding import mesh as shd

QWEN = dict(vocab_size=151936, num_kv_heads=2, qkv_bias=True, tie_embeddings=True,
            max_seq_len=8192, dtype="bfloat16", param_dtype="float32")
SHAPES = {
    "0.5b": ModelConfig(embed_dim=896, num_layers=24, num_heads=14, head_dim=64, mlp_dim=4864,
                        **QWEN),
    "1.5b": ModelConfig(embed_dim=1536, num_layers=28, num_heads=12, head_dim=128,
                        mlp_dim=8960, **QWEN),
    "smoke": ModelConfig(vocab_size=256, embed_dim=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, mlp_dim=128, max_seq_len=1024,
                         dtype="bfloat16", param_dtype="float32"),
}
DEMO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo_cpu.yaml"


def timed(fn, repeats: int) -> float:
    """Median seconds of `fn()` (blocked on), after one call to compile and warm up."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ceilings(n: int, copy_bytes: int) -> dict:
    """Measured bf16 matmul FLOP/s (n x n x n) and device copy bytes/s (read + write)."""
    a = jnp.ones((n, n), jnp.bfloat16)
    matmul = jax.jit(lambda a: a @ a)
    flops = 2 * n**3 / timed(lambda: matmul(a), 10)
    x = jnp.ones((copy_bytes // 2,), jnp.bfloat16)
    copy = jax.jit(lambda x: x + jnp.bfloat16(1))
    bandwidth = 2 * copy_bytes / timed(lambda: copy(x), 10)
    return {"peak_bf16_flops": flops, "copy_bytes_per_s": bandwidth}


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in matmuls per token: the layers and the LM head."""
    d, n, g, h, f = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
    layer = d * n * h * 2 + d * g * h * 2 + 3 * d * f
    return cfg.num_layers * layer + d * cfg.vocab_size


def train_flops(cfg: ModelConfig, rows: int, seq: int) -> float:
    tokens = rows * seq
    attention = 6 * cfg.num_layers * seq * cfg.num_heads * cfg.head_dim   # causal: half of 12
    return tokens * (6 * matmul_params(cfg) + attention)


def train(cfg: ModelConfig, tokens: int, seq: int, remat: str, peak: float) -> dict:
    mesh = shd.make_mesh(shd.MeshConfig(fsdp=1), jax.devices()[:1])
    tx = make_optimizer(OptimConfig(lr=1e-4, warmup_steps=1), 100)
    shardings = state_shardings(cfg, tx, mesh)
    graphdef, _ = split_params(abstract_model(cfg))
    state = init_state(cfg, tx, shardings, seed=0)
    step = jit_train_step(graphdef, tx, shardings, Layout(mesh, remat))
    rows = tokens // seq
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, (1, rows, seq + 1)).astype(np.int32)
    batch = {"input_ids": ids[..., :-1], "targets": ids[..., 1:],
             "loss_mask": np.ones((1, rows, seq), np.float32)}
    temp = step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
    holder = [state]

    def one():
        holder[0], metrics = step(holder[0], batch)
        return metrics
    seconds = timed(one, 5)
    flops = train_flops(cfg, rows, seq)
    return {"remat": remat, "tokens": rows * seq, "step_s": seconds,
            "tflops": flops / seconds / 1e12, "mfu": flops / seconds / peak,
            "device_temp_bytes": int(temp)}


def causal(cfg: ModelConfig, tokens: int, seq: int, peak: float) -> dict:
    """The train step with XLA attention dense and in causal query blocks, and with cuDNN."""
    out = {}
    for name, attention, blocks in (("xla_dense", "xla", 1), ("xla_blocked", "xla", None),
                                    ("cudnn", "cudnn", None)):
        saved = layers.MAX_CAUSAL_BLOCKS
        layers.MAX_CAUSAL_BLOCKS = blocks or saved
        try:
            out[name] = train(dataclasses.replace(cfg, attention=attention), tokens, seq,
                              "none", peak)
        except Exception as e:       # e.g. cuDNN absent on this backend: say so, go on
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        finally:
            layers.MAX_CAUSAL_BLOCKS = saved
    return out


def engine_for(cfg: ModelConfig, slots: int, max_len: int,
               attention: str = "auto") -> tuple[Engine, dict]:
    """A bf16 engine with `attention` ("IMPL" or "IMPL+fp8": the KV cache in float8 e4m3)."""
    attention, _, kv = attention.partition("+")
    engine = Engine(cfg, EngineConfig(max_concurrent_decodes=slots, max_len=max_len,
                                      max_prefill_length=64, prefill_chunk=64, page_size=16,
                                      dtype="bfloat16", attention=attention,
                                      kv_cache_dtype=kv or "auto"))
    return engine, engine.prepare_params(split_params(Transformer(cfg, rngs=nnx.Rngs(0)))[1])


def decode(engine: Engine, params, held: int, steps: int, bandwidth: float,
           one_by_one: bool = False) -> dict:
    """Per-step time of `steps` decode steps with every slot at `held` tokens: one program of
    `steps` steps, or (`one_by_one`) `steps` one-step programs, each read back before the next
    as the engine loop runs them."""
    cfg, s = engine.model_cfg, engine.cfg.max_concurrent_decodes
    width = engine.cfg.table_width(held + steps)
    table = 1 + np.arange(s * width, dtype=np.int32).reshape(s, width) % (engine.num_pages - 1)
    greedy = [SamplingParams(temperature=0.0)] * s
    state = [engine.init_decode_state()]

    def rewind():
        state[0] = engine.insert(state[0], SlotBatch(
            list(range(s)), [held] * s, [3] * s, [1] * s, greedy, [0] * s))

    def run():
        rewind()
        for _ in range(steps if one_by_one else 1):
            state[0], tokens, _ = engine.generate_steps(params, state[0], table,
                                                         1 if one_by_one else steps)
            if one_by_one:
                np.asarray(tokens)
        return tokens
    per_step = timed(run, 5) / steps      # the rewind is a few scatters: counted, small
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    kv = (s * (held + steps / 2) * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim
          * engine.cfg.pool_dtype.itemsize)
    roofline = s / ((weights + kv) / bandwidth)
    return {"slots": s, "held": held, "step_ms": per_step * 1e3, "tokens_per_s": s / per_step,
            "roofline_tokens_per_s": roofline, "fraction_of_roofline": s / per_step / roofline,
            "weight_bytes": weights, "kv_bytes": int(kv)}


def update_pause(engine: Engine, params, prompt_len: int) -> dict:
    """The decode pause of in-flight updates while every slot decodes, against one device copy
    of the weights."""
    copy = jax.jit(lambda p: jax.tree.map(lambda x: x + 0, p))
    one_copy = timed(lambda: copy(params), 5)
    max_tokens = engine.cfg.max_len - prompt_len - 1
    sampling = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=0)
    with Orchestrator(engine, params) as o:
        streams = [o.submit(list(range(3, 3 + prompt_len)), sampling)
                   for _ in range(engine.cfg.max_concurrent_decodes)]
        while o.metrics()["steps"] < 8:      # every slot decoding
            time.sleep(0.01)
        pauses = [o.update_params(copy(params), version).pause_s * 1e3
                  for version in range(1, 6)]
        for stream in streams:
            stream.cancel()
    pause = float(np.median(pauses))
    return {"update_pause_ms": pause, "update_pause_ms_max": max(pauses),
            "one_copy_ms": one_copy * 1e3, "pause_vs_copy": pause / (one_copy * 1e3)}


def rl_modes(shape: str, steps: int) -> dict:
    """Async against sync RL steps/s, colocated on this device, from one short warm-up."""
    import _rl_compare as compare  # the RL stack (gRPC, Grain): only for this section

    cfg = SHAPES[shape]
    model = [f"model.embed_dim={cfg.embed_dim}", f"model.num_layers={cfg.num_layers}",
             f"model.num_heads={cfg.num_heads}", f"model.num_kv_heads={cfg.num_kv_heads}",
             f"model.head_dim={cfg.head_dim}", f"model.mlp_dim={cfg.mlp_dim}",
             "model.dtype=bfloat16", "train.steps=2",
             # An untrained model earns one reward across a group and runs to the length limit,
             # which these filters drop: the steps would wait on learning (regenerating up to
             # 5x the samples), and this section measures the system.
             "rl.filter_zero_advantage=false", "rl.filter_overlong=false"]
    args = argparse.Namespace(config=str(DEMO_CONFIG), rl_steps=steps, target=1.0, window=2,
                              warmup_dir=None, overrides=model)
    work = Path(tempfile.mkdtemp(prefix="jaxrl-gpu-"))
    t0, out = time.perf_counter(), {}
    try:
        base = compare.warm_checkpoint(args, work)
        print(f"rl: warm-up checkpoint after {time.perf_counter() - t0:.0f} s", flush=True)
        for name in ("sync", "async"):
            out[name] = compare.run_variant(base, work, name, args,
                                            log=lambda m: print(f"rl {name}: {m}", flush=True))
            print(f"rl: {name} done after {time.perf_counter() - t0:.0f} s "
                  f"({out[name]['seconds']:.1f} s over steps 2-{steps})", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rate = {name: (len(r["rows"]) - 1) / r["seconds"] for name, r in out.items()}
    return {"sync_steps_per_s": rate["sync"], "async_steps_per_s": rate["async"],
            "async_vs_sync": rate["async"] / rate["sync"],
            "steps": {name: [step_breakdown(row) for row in r["rows"]] for name, r in out.items()}}


BREAKDOWN = ("time_s", "step_s", "trainer_wait_s", "samples_per_s", "generated_tokens_per_s",
             "trained_tokens", "completion_len_p50", "completion_len_max", "slots_busy_fraction",
             "update_pause_ms_max", "process_cpu_s", "samples_generated", "samples_kept")


def step_breakdown(row: dict) -> dict:
    """Where one RL step's time went: the train step, the wait for samples, what was made."""
    return {k: row[k] for k in BREAKDOWN if k in row}


SECTIONS = ("train", "decode", "update", "causal", "admit", "rl", "long_tail")
RL_SECTIONS = ("rl", "long_tail")     # the RL stack: gRPC and Grain


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", nargs="+", default=["0.5b", "1.5b"], choices=list(SHAPES))
    p.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS,
                   help="what to measure (rl: at the first model's shape)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per train step")
    p.add_argument("--seq", type=int, default=4096, help="train sequence length")
    p.add_argument("--causal-seq", type=int, default=1024,
                   help="causal section: sequence length (xla dense holds T x T per layer)")
    p.add_argument("--slots", type=int, default=64, help="decode batch")
    p.add_argument("--held", type=int, default=1024, help="tokens each slot holds")
    p.add_argument("--decode-attention", nargs="+", default=["reference", "triton", "loop"],
                   choices=[f"{a}{kv}" for kv in ("", "+fp8")
                            for a in ("reference", "triton", "loop")],
                   help="the engine's paged attention(s) to decode with (update: the first); "
                        "+fp8: with the KV cache in float8 e4m3")
    p.add_argument("--admit-tokens", type=int, default=6,
                   help="tokens each sample of the admit section generates")
    p.add_argument("--rl-steps", type=int, default=4)
    p.add_argument("--long-tail-steps", type=int, default=5,
                   help="RL steps of each long_tail run")
    p.add_argument("--attention", choices=["xla", "cudnn"], default=None,
                   help="the train step's attention (default: cudnn on a GPU, else xla; xla "
                        "holds every layer's T x T scores: 60 GiB at 0.5B and 4,096 tokens)")
    p.add_argument("--out", default="gpu_campaign.json",
                   help="written after every section, so a run cut short keeps what it measured")
    p.add_argument("--no-rl", action="store_true",
                   help="leave out the RL sections (rl, long_tail)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes and sizes: checks the script, anywhere")
    args = p.parse_args(argv)
    if args.smoke:
        args.models, args.tokens, args.seq, args.causal_seq, args.slots, args.held = (
            ["smoke"], 256, 128, 256, 4, 64)
        args.rl_steps = 3
    sections = [s for s in args.sections if not (args.no_rl and s in RL_SECTIONS)]
    device = jax.devices()[0]
    out = {"device": device.device_kind, "platform": device.platform, "jax": jax.__version__,
           "models": {}}
    t0 = time.perf_counter()

    def save(what: str = ""):
        out["seconds"] = time.perf_counter() - t0
        Path(args.out).write_text(json.dumps(out, indent=1))
        if what:
            print(f"[{out['seconds']:.0f} s] {what}", flush=True)
    out.update(ceilings(*((256, 1 << 22) if args.smoke else (8192, 1 << 30))))
    save(f"{device.device_kind}: bf16 matmul {out['peak_bf16_flops'] / 1e12:.0f} TFLOP/s, "
         f"copy {out['copy_bytes_per_s'] / 1e9:.0f} GB/s")
    attention = args.attention or ("cudnn" if device.platform == "gpu" else "xla")
    out["attention"] = attention
    for name in args.models:
        cfg = dataclasses.replace(SHAPES[name], attention=attention)
        row = out["models"][name] = {}
        if "train" in sections:
            row["train"] = [train(cfg, args.tokens, args.seq, remat, out["peak_bf16_flops"])
                            for remat in ("none", "offload")]
            none, offload = row["train"]
            row["offload_vs_none_time"] = offload["step_s"] / none["step_s"]
            row["offload_vs_none_temp"] = offload["device_temp_bytes"] / none["device_temp_bytes"]
            save(f"{name} train: MFU {none['mfu']:.1%} (offload {offload['mfu']:.1%}, "
                 f"{row['offload_vs_none_time']:.2f}x time, "
                 f"{row['offload_vs_none_temp']:.2f}x temp)")
        if "causal" in sections:
            row["causal"] = causal(cfg, args.tokens, args.causal_seq, out["peak_bf16_flops"])
            save(f"{name} causal at {args.causal_seq}: " + ", ".join(
                f"{k} {v['step_s'] * 1e3:.1f} ms" if "step_s" in v else f"{k} failed"
                for k, v in row["causal"].items()))
        if "decode" in sections or "update" in sections:
            row["decode"] = {}
            for impl in args.decode_attention:
                engine, params = engine_for(cfg, args.slots, args.held + 128, impl)
                if "decode" in sections:
                    try:
                        d = row["decode"][impl] = decode(engine, params, args.held, 16,
                                                         out["copy_bytes_per_s"])
                    except Exception as e:      # a kernel that fails to compile: noted
                        row["decode"][impl] = {"error": f"{type(e).__name__}: {e}"[:2000]}
                        save(f"{name} decode ({impl}) failed: {row['decode'][impl]['error']}")
                        continue
                    save(f"{name} decode ({impl}): {d['step_ms']:.2f} ms/step, "
                         f"{d['tokens_per_s']:.0f} tok/s = {d['fraction_of_roofline']:.1%} of "
                         f"roofline")
                    loop = loop_step(engine, params, min(args.held, 64),
                                     window_s=0.02 if args.smoke else 0.1)
                    program = decode(engine, params, round(loop["held_mean"]), 16,
                                     out["copy_bytes_per_s"], one_by_one=True)["step_ms"]
                    d.update(loop, program_step_ms=program,
                             engine_vs_program=loop["engine_step_ms"] / program)
                    save(f"{name} engine loop ({impl}): {loop['engine_step_ms']:.2f} ms/step "
                         f"= {d['engine_vs_program']:.2f}x the one-step program")
                if "update" in sections and impl == args.decode_attention[0]:
                    u = row["update"] = update_pause(engine, params, 16)
                    save(f"{name} update pause {u['update_pause_ms']:.3f} ms = "
                         f"{u['pause_vs_copy']:.3f}x one copy")
                del engine
        if "admit" in sections:
            new = args.admit_tokens
            engine = Engine(cfg, EngineConfig(max_concurrent_decodes=32, max_len=8 + new + 2,
                                              max_prefill_length=8, prefill_chunk=8,
                                              dtype="bfloat16"))
            params = engine.prepare_params(split_params(Transformer(cfg, rngs=nnx.Rngs(0)))[1])
            a = row["admit"] = admit(engine, params, max_tokens=new)
            save(f"{name} admit: 256 samples x {new} tokens in {a['wave_ms']:.0f} ms "
                 f"({a['samples_per_s']:.0f} samples/s), {a['decode_steps']:.0f} decode steps "
                 f"of {a['ms_per_decode_step']:.2f} ms, {a['slots_busy_fraction']:.0%} full")
            del engine
        if "long_tail" in sections:
            from _gpu_long_tail import SMOKE, long_tail
            t = row["long_tail"] = long_tail(cfg, args.long_tail_steps,
                                             SMOKE if args.smoke else [])
            save(f"{name} long_tail: " + ", ".join(
                f"{m} {r['vs_sync']:.2f}x sync (simulated "
                f"{'-'.join(f'{x:.2f}' for x in sorted(set(r['predicted_vs_sync'])))}x)"
                for m, r in t.items()))
    if "rl" in sections:
        out["rl"] = rl_modes(args.models[0], args.rl_steps)
        save(f"RL on one device: async {out['rl']['async_vs_sync']:.2f}x sync steps/s")
        for name, steps in out["rl"]["steps"].items():
            print(f"rl {name}: " + "; ".join(
                f"step {r.get('step_s', 0):.2f} s, wait {r.get('trainer_wait_s', 0):.2f} s, "
                f"{r.get('generated_tokens_per_s', 0):.0f} gen tok/s" for r in steps), flush=True)
    save(f"wrote {args.out}")


if __name__ == "__main__":
    main()
