"""Ahead-of-time compiles for a v5e TPU slice with libtpu (no TPU): remat policies, pipeline
schedules, optimizer offload, a step that fits only with offload, the `jaxrl compile` command, and the
Pallas kernels (splash attention, the engine's paged decode attention).

All in this one process: libtpu allows one process per machine."""

import functools
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jaxrl.commands.compile import compile_generate_step, compile_train_step
from jaxrl.config import load_run_config
from jaxrl.models import ModelConfig, abstract_model, merge_params, split_params
from serving.runner.engine import Engine, EngineConfig
from sharding import mesh as shd
from sharding.aot import tpu_devices

pytestmark = [pytest.mark.tpu_aot, pytest.mark.multi_device]
ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "configs/demo_cpu.yaml")
SEQ_64 = ["train.seq_len=64", "model.max_seq_len=64"]


@functools.cache
def compiled(config, *overrides, topology="v5e:2x4"):
    """compile_train_step's report; each configuration is compiled once per session."""
    return compile_train_step(load_run_config(config, list(overrides)), topology)


def test_offload_makes_a_step_that_does_not_fit_a_v5e_chip_fit():
    """The demo model's shape, 8 layers at 2,048 tokens in rows of 64: without remat the step's
    activations need more than a v5e chip's 16 GiB (the compiler's estimate, 45 GiB) and
    nothing on host; with offload it fits in under half the device memory and keeps
    activations on host. The smallest step that shows it; Llama 3.2 1B's shape does the same
    at 1,024 tokens (`jaxrl compile --topology v5e:2x4 --config configs/llama_1b_v5e.yaml
    train.seq_len=1024 train.remat=none`, then `=offload`). (The demo model's offload inside a
    pipeline is compiled by the pipeline tests below.)"""
    shape = ["model.num_layers=8", "train.seq_len=2048", "model.max_seq_len=2048",
             "train.batch_size=64"]
    none = compiled(DEMO, "train.remat=none", *shape)
    offload = compiled(DEMO, "train.remat=offload", *shape)
    assert not none["fits"] and none["device_temp_bytes"] > 16 * 2**30 * 0.9
    assert none["host_temp_bytes"] == 0
    assert offload["fits"] and offload["host_temp_bytes"] > 0
    assert offload["device_temp_bytes"] <= none["device_temp_bytes"] / 2


PIPE = ["sharding.pipeline.stages=2", "sharding.pipeline.microbatches=8", *SEQ_64]


def test_pipeline_schedules_compile_and_1f1b_keeps_fewer_activations():
    gpipe = compiled(DEMO, *PIPE)
    circular = compiled(DEMO, *PIPE, "sharding.pipeline.schedule=circular",
                        "sharding.pipeline.repeats=2")
    one_f_one_b = compiled(DEMO, *PIPE, "sharding.pipeline.schedule=1f1b")
    assert all(r["fits"] for r in (gpipe, circular, one_f_one_b))
    # Both keep every activation the backward reads (the demo's train.remat=none): gpipe for
    # all m = 8 microbatches, 1F1B for the p = 2 in flight, one more while an F's output is
    # written into its slot, and a message in the inbox.
    assert one_f_one_b["device_temp_bytes"] <= gpipe["device_temp_bytes"] / 2
    # Keeping each layer's input instead (remat=full) leaves 1F1B a small fraction.
    inputs_only = compiled(DEMO, *PIPE, "sharding.pipeline.schedule=1f1b", "train.remat=full")
    assert inputs_only["device_temp_bytes"] <= gpipe["device_temp_bytes"] / 4


def test_a_table_schedule_compiles_beside_fsdp_and_tensor_together():
    """XLA's TPU partitioner aborted the process on a head sharded over fsdp and tensor inside
    the per-stage `lax.switch`; with the heads replicated there the step compiles."""
    both = ["mesh.fsdp=2", "mesh.tensor=2", "sharding.pipeline.schedule=zb-h1"]
    report = compiled(DEMO, *PIPE, *both)
    assert report["fits"] and report["device_temp_bytes"] > 0


def test_offload_nested_in_the_pipeline():
    gpipe = compiled(DEMO, *PIPE)
    stage_inputs = compiled(DEMO, *PIPE, "sharding.pipeline.offload_stage_inputs=true")
    assert stage_inputs["host_temp_bytes"] > 0
    assert stage_inputs["device_temp_bytes"] <= gpipe["device_temp_bytes"] / 2
    layers = compiled(DEMO, *PIPE, "sharding.pipeline.schedule=1f1b", "train.remat=offload")
    assert layers["host_temp_bytes"] > 0
    # Per-layer offload inside the gpipe scan: XLA's TPU compiler rejects it; a clear error.
    with pytest.raises(ValueError, match=r"train.remat=offload inside a gpipe pipeline "
                                         r"\(sharding.pipeline.stages=2\) does not compile"):
        compiled(DEMO, *PIPE, "train.remat=offload")


def test_optimizer_state_offload_moves_arguments_to_host():
    device, host = compiled(DEMO), compiled(DEMO, "train.offload_optimizer=true")
    assert device["host_argument_bytes"] == 0 and host["host_argument_bytes"] > 0
    # AdamW's two moments are twice the parameters: two thirds of the state leave the chip.
    assert host["argument_bytes"] <= device["argument_bytes"] * 0.4


def test_generate_step_compiles_with_its_kv_cache():
    # (TPU tiling pads the slot dimension: 32 and 128 slots take the same bytes)
    small = compile_generate_step(load_run_config(DEMO), "v5e:2x4")
    more_slots = compile_generate_step(
        load_run_config(DEMO, ["rl.engine.max_concurrent_decodes=512"]), "v5e:2x4")
    assert small["fits"] and more_slots["argument_bytes"] > small["argument_bytes"]


def test_compile_command_prints_memory_and_json(capsys):
    from jaxrl.cli import main

    assert main(["compile", "--topology", "v5e:2x2", "--config", DEMO, "train.remat=full",
                 "sharding.pipeline.stages=2"]) == 0
    out = capsys.readouterr().out
    assert "gpipe pipeline: 2 stages x 4 microbatches x 1 repeats, bubble 20.0%" in out
    last = json.loads(out.strip().splitlines()[-1])
    assert {"device_temp_bytes", "host_temp_bytes", "argument_bytes", "fits"} <= set(last)
    assert last["device_temp_bytes"] > 0 and last["fits"] is True
    assert last["bubble_fraction"] == pytest.approx(0.2) and last["generate"]["fits"] is True
    assert main(["compile", "--topology", "v9:1x1"]) == 2
    assert "topology 'v9:1x1' is not of the form" in capsys.readouterr().err


# -- Pallas kernels --------------------------------------------------------------------------------

@pytest.mark.parametrize("topology", ["v5e:2x2", "v5p:2x2x1"])
def test_splash_attention_compiles_for_tpu_on_a_sharded_mesh(topology):
    """Rows over fsdp, key/value heads over tensor: the kernel runs inside shard_map (Mosaic
    kernels cannot be partitioned automatically), 4 query heads on 2 key/value heads without
    repeating K/V."""
    mesh = shd.make_mesh(shd.MeshConfig(fsdp=2, tensor=2), tpu_devices(topology))
    cfg = ModelConfig(vocab_size=256, embed_dim=256, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=128, mlp_dim=512, attention="splash",
                      dtype="bfloat16")
    graphdef, abstract = split_params(abstract_model(cfg))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated),
                          abstract)
    ids = jax.ShapeDtypeStruct((4, 256), jnp.int32, sharding=rows)
    segments = jax.ShapeDtypeStruct((4, 256), jnp.int32, sharding=rows)

    def forward(p, x, s):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return merge_params(graphdef, p)(x, segment_ids_BT=s)

    compiled = jax.jit(forward).lower(params, ids, segments).compile()
    assert "tpu_custom_call" in compiled.as_text()  # the Pallas kernel, not an XLA fallback
    assert compiled.memory_analysis().temp_size_in_bytes > 0


# Llama-like heads (head_dim 128, GQA 2:1) in bfloat16, pages of 16 tokens.
KERNEL_CFG = ModelConfig(vocab_size=256, embed_dim=512, num_layers=2, num_heads=8,
                         num_kv_heads=4, head_dim=128, mlp_dim=1024)
KERNEL_ENGINE = EngineConfig(max_concurrent_decodes=8, max_len=512, max_prefill_length=64,
                             prefill_chunk=64, page_size=16, dtype="bfloat16", attention="pallas")


@pytest.mark.parametrize("topology,tensor", [("v5e:2x2", 4), ("v5p:2x2x1", 2)])
def test_paged_attention_compiles_into_the_decode_step_for_tpu(topology, tensor):
    """The engine's decode steps with the Pallas paged-attention kernel, kv heads sharded over
    the tensor axis (the kernel in shard_map), compiled by Mosaic for the slice."""
    devices = tpu_devices(topology)
    mesh = shd.make_mesh(shd.MeshConfig(fsdp=1, tensor=tensor), devices[:tensor])
    engine = Engine(KERNEL_CFG, KERNEL_ENGINE, mesh=mesh)
    assert engine.pool_sharding.spec[3] == "tensor"
    compiled = engine.programs.lower("decode", (8, KERNEL_ENGINE.pages_per_sequence)).compile()
    text = compiled.as_text()
    assert "tpu_custom_call" in text and "_kernel" in text


def test_a_process_without_jax_platforms_leaves_libtpu_to_the_tpu_compile(tmp_path):
    """`jaxrl serve` started without JAX_PLATFORMS on this TPU-less machine (libtpu installed):
    it never loads libtpu (its memory map shows none) nor says anything about it, and a TPU
    compile in this process goes on beside it."""
    import os
    import subprocess
    import sys
    import threading

    import numpy as np

    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    proc = subprocess.Popen([sys.executable, "-m", "jaxrl.cli", "serve", "--port", "0",
                             "--checkpoint", str(tmp_path / "none"), "--slots", "2",
                             "--max-len", "48"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
    try:
        output = []
        for line in proc.stdout:
            output.append(line)
            if "ready on" in line:
                break
        assert "ready on" in output[-1], "".join(output)[-3000:]
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "libtpu" not in maps
        assert not any("libtpu" in line.lower() or "tpu" in line.split() for line in output)
        devices = np.asarray(tpu_devices("v5e:2x2")).reshape(4)
        sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(devices, ("x",)),
                                              jax.sharding.PartitionSpec("x"))
        arg = jax.ShapeDtypeStruct((1024,), jnp.float32, sharding=sharding)
        compiled_fn = jax.jit(lambda x: jnp.sin(x) * 2).lower(arg).compile()
        assert compiled_fn.memory_analysis() is not None
    finally:
        proc.kill()
        proc.wait(60)


def test_a_tpu_compile_goes_on_with_xla_cpu_flags_set():
    """A process whose XLA_FLAGS hold an XLA:CPU flag that libtpu's XLA does not know (this
    suite's own, or a user's CPU tuning) still compiles for TPU: libtpu aborted such a process
    at its first compile (`Unknown flag in XLA_FLAGS`)."""
    import subprocess
    import sys

    script = """
import jax, jax.numpy as jnp
from sharding.aot import tpu_devices
jax.jit(jnp.negative).lower(1.0).compile()
device = tpu_devices("v5e:2x2")[0]
at = jax.sharding.SingleDeviceSharding(device)
tpu = jax.jit(jnp.sin).lower(jax.ShapeDtypeStruct((8,), jnp.float32, sharding=at)).compile()
print("compiled", type(tpu).__name__, tpu.memory_analysis() is not None)
"""
    # ALLOW_MULTIPLE_LIBTPU_LOAD: this worker holds libtpu's lock from the tests before.
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
           "XLA_FLAGS": "--xla_cpu_use_fusion_emitters=false --xla_cpu_enable_fast_math=false"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiled Compiled True" in done.stdout


# -- Long sequences ---------------------------------------------------------------------------

def test_splash_tables_fit_smem_at_128k_and_an_oversized_one_is_reported(monkeypatch):
    """The splash kernel's forward and backward at 131,072 tokens compile for a v5p chip with
    the grown blocks (512: 256 x 256 tables); forced to blocks of 128 (1,024 x 1,024) its
    tables need more SMEM than the core has, and `jaxrl compile` says so by name."""
    from jaxrl.commands.compile import _memory
    from jaxrl.models import splash

    at = jax.sharding.SingleDeviceSharding(tpu_devices("v5p:2x2x1")[0])
    t = 131072
    q = jax.ShapeDtypeStruct((1, t, 128), jnp.bfloat16, sharding=at)
    kv = jax.ShapeDtypeStruct((t, 128), jnp.bfloat16, sharding=at)

    def loss(kern):
        return lambda q, k, v: kern(q, k, v).astype(jnp.float32).sum()

    both_passes = jax.jit(jax.grad(loss(splash.kernel(t, 1)), argnums=(0, 1, 2)))
    fits = _memory(both_passes.lower(q, kv, kv), (q, kv, kv), "v5p:2x2x1", "splash")
    assert fits["fits"] and "note" not in fits
    monkeypatch.setattr(splash, "PREFERRED_BLOCK", 128)
    monkeypatch.setattr(splash, "MAX_GRID", 2**20)
    forward = jax.jit(loss(splash._make_kernel(t, 1, 1, False)))   # its tables overflow
    small_blocks = _memory(forward.lower(q, kv, kv), (q, kv, kv), "v5p:2x2x1", "splash")
    assert not small_blocks["fits"] and small_blocks["memory"] == "SMEM"
    assert small_blocks["needed_bytes"] > small_blocks["available_bytes"]
    assert small_blocks["note"].startswith(
        f"does not fit: {small_blocks['needed_bytes']:,} bytes of SMEM needed, "
        f"{small_blocks['available_bytes']:,} available (splash's kernel splash_mqa")


def test_context_parallel_train_step_compiles_with_splash_on_every_chip():
    """Rows split over context=4 on v5p:2x2x1, the splash kernel in shard_map with its block
    tables split by query shard: the step compiles, and each of the 4 chips needs under half
    the device memory that one chip needs for the same 2,048-token row."""
    model = ["model.attention=splash", "model.head_dim=128", "model.dtype=bfloat16",
             "train.seq_len=2048", "model.max_seq_len=2048", "train.batch_size=1",
             "train.remat=full", "rl.steps=0"]
    split = compiled(DEMO, *model, "mesh.fsdp=1", "mesh.context=4", topology="v5p:2x2x1")
    whole = compiled(DEMO, *model, "mesh.fsdp=1", topology="v5p:1x1x1")
    assert split["fits"] and whole["fits"]
    assert split["device_temp_bytes"] < whole["device_temp_bytes"] / 2


def test_explain_memory_names_the_peaks_largest_buffers_by_their_jax_ops():
    """`jaxrl compile --explain-memory` (its own process: the compiler reads the dump flags at
    its start): the live bytes at the peak are at most the temp allocation, the buffers come
    largest first, and the largest are named by the traced train step's operations."""
    import subprocess
    import sys

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    done = subprocess.run([sys.executable, "-m", "jaxrl.cli", "compile", "--explain-memory",
                           "--topology", "v5e:2x2", "--config", DEMO, "train.remat=none"],
                          env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "at the peak:" in done.stdout
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert 0 < report["peak_live_bytes"] <= report["device_temp_bytes"]
    sizes = [b["bytes"] for b in report["peak_buffers"]]
    assert sizes == sorted(sizes, reverse=True) and len(sizes) == 12
    assert report["peak_buffers"][0]["op"].startswith("jit(step)/")
