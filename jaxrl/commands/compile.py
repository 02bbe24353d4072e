"""`jaxrl compile --topology v5e:2x4`: the train step compiled ahead of time for a TPU slice on
a machine without one (JAX + libtpu), and the per-device memory it would need."""

from __future__ import annotations

import json
import math
import os
import re
import tempfile

import jax
import jax.numpy as jnp

from jaxrl.config import RunConfig
from jaxrl.models import abstract_model
from jaxrl.models.transformer import split_params
from jaxrl.recipe import model_config
from jaxrl.train.objectives import SupervisedLoss
from jaxrl.train.optim import lr_schedule, make_optimizer
from jaxrl.train.state import abstract_state, state_shardings
from jaxrl.train.step import Layout, jit_train_step
from sharding import buffers
from sharding import mesh as shd
from sharding import schedules as sch
from sharding.aot import tpu_devices
from sharding.buffers import Peak
from sharding.layer_order import LayerOrder

# HBM per chip, bytes.
HBM_BYTES = {"v4": 32 * 2**30, "v5e": 16 * 2**30, "v5p": 95 * 2**30, "v6e": 32 * 2**30}


def compile_generate_step(cfg: RunConfig, topology: str) -> dict:
    """Per-device bytes of the engine's decode step (every slot, one token) for `topology`, with
    the engine sized as `jaxrl train` sizes it for RL (rl.engine.max_concurrent_decodes,
    rl.max_prompt_len + rl.max_new_tokens), its weights over all the slice's chips (tensor
    axis), and every slot's page table as wide as the longest sequence (the step's worst
    case)."""
    from jaxrl.rollout.generation import engine_config
    from serving.runner.engine import Engine

    devices = tpu_devices(topology)
    model_cfg = model_config(cfg)
    engine = Engine(model_cfg, engine_config(cfg, model_cfg),
                    mesh=shd.make_mesh(shd.MeshConfig(fsdp=1, tensor=-1), devices))
    slots, pages = engine.cfg.max_concurrent_decodes, engine.cfg.pages_per_sequence
    program = engine.programs
    args = program.args("decode", (slots, pages))
    return _memory(program.lower("decode", (slots, pages)), args, topology,
                   "the generate step")


def report(cfg: RunConfig, topology: str, explain_memory: bool = False, out=print) -> None:
    """`jaxrl compile`: both steps compiled for `topology`, their per-device memory printed
    (the pipeline's table first, if any), and a last line of JSON."""
    if explain_memory:
        train, peak = explain_train_step(cfg, topology)
    else:
        train, peak = compile_train_step(cfg, topology), None
    generate = compile_generate_step(cfg, topology)
    pipe = cfg.sharding.pipeline
    layout = _layout(cfg, out)
    for name, memory, what in (("train step", train, layout),
                               ("generate step", generate,
                                f"{cfg.rl.engine.max_concurrent_decodes} slots")):
        out(f"{name} compiled for {topology} ({what}), per device:")
        for key in ("argument_bytes", "host_argument_bytes", "device_temp_bytes",
                    "host_temp_bytes", "output_bytes"):
            out(f"  {key:<19} {memory[key] / 2**20:10.1f} MiB")
        out(f"  fits: {memory['fits']}" + (f" ({memory['note']})" if "note" in memory else ""))
        if peak is not None and name == "train step":
            out("  " + peak.render().replace("\n", "\n  "))
    keys = ("device_temp_bytes", "host_temp_bytes", "argument_bytes", "fits")
    summary = {k: train[k] for k in keys}
    if pipe.enabled:
        summary["bubble_fraction"] = pipe.bubble_fraction(cfg.model.num_layers)
    if pipe.table is not None:
        summary["table_peak_activations"] = float(pipe.table.peak())
        summary["paper_peak_activations"] = sch.paper_activations(pipe.schedule, pipe.stages)
    if peak is not None:
        summary["peak_live_bytes"] = peak.bytes
        summary["peak_buffers"] = [{"bytes": b.bytes, "shape": b.shape.split("{")[0],
                                    "op": b.op or b.name} for b in peak.buffers[:12]]
    summary["generate"] = {k: generate[k] for k in keys}
    out(json.dumps(summary))


def _layout(cfg: RunConfig, out) -> str:
    """The train step's layout beyond the mesh, in words; a pipeline's schedule printed."""
    pipe = cfg.sharding.pipeline
    layout = f"remat={cfg.train.remat}"
    if cfg.train.offload_optimizer:
        layout += ", optimizer state on host"
    if not pipe.enabled:
        return layout
    layout += (f", {pipe.schedule} pipeline: {pipe.stages} stages x {pipe.microbatches} "
               f"microbatches x {pipe.repeats} repeats, bubble "
               f"{pipe.bubble_fraction(cfg.model.num_layers):.1%}")
    if pipe.schedule == "helix":
        plan, ratio = pipe.helix(cfg.model.num_layers), attention_ratio(cfg.model,
                                                                        cfg.train.seq_len)
        layout += (f" with every part of a layer costing the same, {plan.bubble(1, ratio):.1%} "
                   f"at {cfg.train.seq_len:,} tokens' attention/weighted FLOP ratio "
                   f"{ratio:.2f}")
        out(f"helix schedule ({plan.waves} waves of {plan.wave} microbatches; each round, "
            f"the boundary w<wave>:<i> a stage runs):")
        out(plan.render())
    if pipe.table is not None:
        layout += f", peak activations {float(pipe.table.peak()):.2f} stage-microbatches"
        paper = sch.paper_activations(pipe.schedule, pipe.stages)
        if paper is not None:
            layout += f" (the controllable-memory paper counts {paper})"
        if pipe.table.split:
            layout += (", W reads B's stash" if pipe.split_backward == "stash" else
                       ", W recomputes the layer")
        out(f"{pipe.schedule} schedule table (F forward, B input gradient, W weight "
            f"gradient, X both; lower case: a stage's second chunk):")
        out(pipe.table.render())
    return layout


def attention_ratio(model, length: int) -> float:
    """A layer's causal attention FLOPs over its weighted parts' (projections, MLP; the
    experts a token uses), per token of a `length`-token row."""
    D, N, G, H = model.embed_dim, model.num_heads, model.num_kv_heads, model.head_dim
    mlp = (3 * D * model.moe_mlp_dim * model.experts_per_token if model.num_experts
           else 3 * D * model.mlp_dim)
    weighted = 2 * (2 * D * N * H + 2 * D * G * H + mlp)
    return 2 * length * N * H / weighted


def explain_train_step(cfg: RunConfig, topology: str) -> tuple[dict, Peak]:
    """`compile_train_step`'s report and what its device temp holds at the peak (the largest
    buffers, by the JAX operation that made them), from the compiler's dumps. The compiler must
    start here: libtpu reads its flags (the dump's) at the process's first TPU compile."""
    with tempfile.TemporaryDirectory(prefix="jaxrl-xla-dump-") as directory:
        flags = os.environ.get("XLA_FLAGS")
        os.environ["XLA_FLAGS"] = f"{flags or ''} {buffers.dump_flags(directory)}".strip()
        try:
            report = compile_train_step(cfg, topology)
        finally:
            if flags is None:
                os.environ.pop("XLA_FLAGS")
            else:
                os.environ["XLA_FLAGS"] = flags
        try:
            return report, buffers.peak(directory)
        except FileNotFoundError as e:
            raise ValueError("--explain-memory needs the process's first TPU compile (the "
                             "compiler reads its dump flags once, at its start)") from e


def compile_train_step(cfg: RunConfig, topology: str) -> dict:
    """Per-device bytes of the supervised train step of `cfg` compiled for `topology`."""
    devices = tpu_devices(topology)
    mesh = shd.make_mesh(cfg.mesh, devices)
    model_cfg = model_config(cfg).for_platform(devices[0].platform)   # as the trainer does
    tx = make_optimizer(cfg.optim, cfg.train.steps or 1)
    shardings = state_shardings(model_cfg, tx, mesh,
                                offload_optimizer=cfg.train.offload_optimizer)
    state = abstract_state(model_cfg, tx, shardings)
    graphdef, _ = split_params(abstract_model(model_cfg))
    order = LayerOrder.for_pipeline(cfg.sharding.pipeline, model_cfg.num_layers)
    layout = Layout(mesh, cfg.train.remat, cfg.sharding.pipeline, order is not None)
    step = jit_train_step(graphdef, tx, shardings, layout, lr_schedule(cfg.optim, 1),
                          SupervisedLoss(cfg.train.logits_chunk))   # as the trainer runs it
    t = cfg.train
    shape = (t.microbatches, t.batch_size // t.microbatches, t.seq_len)
    sharding = shd.batch_sharding(mesh, 3, leading=1)
    batch = {k: jax.ShapeDtypeStruct(shape, dt, sharding=sharding) for k, dt in
             (("input_ids", jnp.int32), ("targets", jnp.int32), ("loss_mask", jnp.float32))}
    return _memory(step.lower(state, batch), (state, batch), topology)


def _memory(lowered, args, topology: str, program: str = "the train step") -> dict:
    """Per-device bytes of `lowered` (a program lowered with abstract `args`) once compiled."""
    try:
        memory = lowered.compile().memory_analysis()
    except jax.errors.JaxRuntimeError as e:
        return _out_of_memory(e, args, program)
    out = {"device_temp_bytes": int(memory.temp_size_in_bytes),
           "host_temp_bytes": int(memory.host_temp_size_in_bytes),
           "argument_bytes": int(memory.argument_size_in_bytes),
           "host_argument_bytes": int(memory.host_argument_size_in_bytes),
           "output_bytes": int(memory.output_size_in_bytes)}
    hbm = HBM_BYTES[topology.split(":")[0]]
    out["fits"] = out["device_temp_bytes"] + out["argument_bytes"] <= hbm
    return out


_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = r"([\d.]+)([KMGT]?)"
# The three ways libtpu refuses a program for memory, each with what it needed and had:
_HBM = re.compile(rf"Used {_SIZE} of {_SIZE} hbm")
_HBM_TEMPORARIES = re.compile(rf"HLO temporaries \({_SIZE}\) exceeds available HBM \({_SIZE}\)")
_VMEM = re.compile(rf"allocating on stack for %(\S+) = \(([^)]*)\).*?Scoped allocation with "
                   rf"size {_SIZE} and limit {_SIZE}", re.S)
_SPACE = re.compile(r"Allocation \(size=(\d+)\) would exceed memory \(size=(\d+)\) :: "
                    r"#\S+ \[shape = '([^']*)', space=(\w+),.*?tag = '([^']*)'\] :: (\S+)",
                    re.S)


def _out_of_memory(error: Exception, args, program: str = "the train step") -> dict:
    """The compiler refuses a program whose buffers exceed a memory: HBM (its temporaries),
    the scoped VMEM of one fusion (e.g. XLA attention's [.., T, T] scores at long T), or the
    SMEM or VMEM of a Pallas kernel's operand (e.g. splash attention's block tables). Report
    it as "does not fit: N bytes of MEMORY needed, M available" naming the program and the
    buffer, instead of failing. Other compile errors propagate."""
    text = str(error)
    per_device = sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
                     for a in jax.tree.leaves(args))
    out = {"device_temp_bytes": 0, "host_temp_bytes": 0, "argument_bytes": per_device,
           "host_argument_bytes": 0, "output_bytes": 0, "fits": False}
    if m := _HBM.search(text) or _HBM_TEMPORARIES.search(text):
        need, have = _bytes(*m.group(1, 2)), _bytes(*m.group(3, 4))
        found = ("HBM", need, have, program, "its temporaries and arguments")
        temporaries = re.search(rf"HLO temporaries \({_SIZE}\)", text)
        out["device_temp_bytes"] = (_bytes(*temporaries.group(1, 2)) if temporaries
                                    else need - per_device)
    elif m := _VMEM.search(text):
        need, have = _bytes(*m.group(3, 4)), _bytes(*m.group(5, 6))
        found = ("scoped VMEM", need, have, f"{program}'s fusion {m.group(1)}",
                 f"its {m.group(2)} output")
    elif m := _SPACE.search(text):
        need, have = int(m.group(1)), int(m.group(2))
        found = (m.group(4).upper(), need, have, f"{program}'s kernel {m.group(6)}",
                 f"{m.group(5)} ({m.group(3)})")
    else:
        raise error
    memory, need, have, where, buffer = found
    out.update(memory=memory, needed_bytes=need, available_bytes=have, program=where,
               buffer=buffer)
    out["note"] = (f"does not fit: {need:,} bytes of {memory} needed, {have:,} available "
                   f"({where}, {buffer})")
    return out


def _bytes(number: str, unit: str) -> int:
    return int(float(number) * _UNITS.get(unit, 1))
