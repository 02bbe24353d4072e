"""The engine's fused attention hook: the Pallas TPU ragged paged attention kernel compiles into
the decode step for a TPU slice, sharded over kv heads, and is refused where it cannot run."""

import jax
import jax.numpy as jnp
import pytest

from jaxrl.models import ModelConfig
from serving.engine import Engine, EngineConfig
from sharding import mesh as shd

KERNEL_CFG = ModelConfig(vocab_size=256, embed_dim=512, num_layers=2, num_heads=8,
                         num_kv_heads=4, head_dim=128, mlp_dim=1024)
SIZES = EngineConfig(max_concurrent_decodes=8, max_len=512, max_prefill_length=64,
                     prefill_chunk=64, page_size=16, dtype="bfloat16", attention="ragged")


@pytest.mark.tpu_aot
def test_ragged_paged_attention_compiles_into_the_decode_step_for_tpu():
    from sharding.aot import tpu_devices

    mesh = shd.make_mesh(shd.MeshConfig(fsdp=1, tensor=-1), tpu_devices("v5e:2x2"))
    engine = Engine(KERNEL_CFG, SIZES, mesh=mesh)
    assert engine.pool_sharding.spec[3] == "tensor"     # 4 kv heads over 4 chips: shard_map
    table = jax.ShapeDtypeStruct((8, SIZES.pages_per_sequence), jnp.int32,
                                 sharding=shd.replicated(mesh))
    compiled = Engine._generate_steps.lower(engine, engine.param_target,
                                            engine.abstract_decode_state(), table, 1).compile()
    text = compiled.as_text()
    assert "tpu_custom_call" in text and "ragged_paged_attention" in text


def test_ragged_attention_is_refused_off_tpu_and_for_narrow_heads():
    with pytest.raises(ValueError, match="attention='ragged' is the Pallas TPU kernel; on cpu"):
        Engine(KERNEL_CFG, SIZES)
    narrow = ModelConfig(vocab_size=32, embed_dim=64, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=64, mlp_dim=64)
    with pytest.raises(ValueError, match="needs head_dim a multiple of 128.*head_dim=64"):
        Engine(narrow, SIZES)
