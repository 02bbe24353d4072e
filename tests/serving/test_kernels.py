"""The engine's fused attention hook is refused where it cannot run. (That the Pallas TPU ragged
paged attention kernel compiles into the decode step is in tests/sharding/test_tpu_aot.py, with
every other TPU compile: libtpu allows one process per machine.)"""

import pytest

from jaxrl.models import ModelConfig
from serving.engine import Engine, EngineConfig

KERNEL_CFG = ModelConfig(vocab_size=256, embed_dim=512, num_layers=2, num_heads=8,
                         num_kv_heads=4, head_dim=128, mlp_dim=1024)
SIZES = EngineConfig(max_concurrent_decodes=8, max_len=512, max_prefill_length=64,
                     prefill_chunk=64, page_size=16, dtype="bfloat16", attention="ragged")


def test_ragged_attention_is_refused_off_tpu_and_for_narrow_heads():
    with pytest.raises(ValueError, match="attention='ragged' is the Pallas TPU kernel; on cpu"):
        Engine(KERNEL_CFG, SIZES)
    narrow = ModelConfig(vocab_size=32, embed_dim=64, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=64, mlp_dim=64)
    with pytest.raises(ValueError, match="needs head_dim a multiple of 128.*head_dim=64"):
        Engine(narrow, SIZES)
