"""`jaxrl compile` reports every compiler out-of-memory as "does not fit", with the compiler's
own figure, and lets other compile errors through."""

import jax
import jax.numpy as jnp
import pytest

from jaxrl.commands.compile import _out_of_memory

pytestmark = pytest.mark.slow

ARGS = [jax.ShapeDtypeStruct((4, 1024), jnp.float32,
                             sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))]
# The message libtpu gave for train.seq_len=8192 on v5p:2x2x1 (configs/llama_1b_v5e.yaml).
VMEM = ("RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom:\nRan out of memory in memory "
        "space vmem while allocating on stack for %fusion.456 = (f32[4,8,4,8192]) fusion(). "
        "Scoped allocation with size 16.25M and limit 16.00M exceeded scoped vmem limit by "
        "256.0K. It should not be possible to run out of scoped vmem - ")
HBM = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space "
       "hbm. Used 806.42G of 95.74G hbm. Exceeded hbm capacity by 710.68G.\n\nTotal hbm usage "
       ">= 806.42G:\n    reserved 1.00M\n    program 802.96G\n    arguments 3.45G\n\n"
       "HLO temporaries (802.96G) exceeds available HBM")


# The shorter form of the same (the 1B-class step at 1,024 tokens without remat on v5e:2x4).
HBM_TEMPORARIES = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the "
                   "total memory required for HLO temporaries (33.47G) exceeds available HBM "
                   "(15.75G). HLO module: jit_step.")
# The message libtpu gave for the splash kernel's block tables at 131,072 tokens in blocks of
# 128 (1,024 x 1,024 entries) on v5p:2x2x1.
SMEM = ("RESOURCE_EXHAUSTED: Allocation (size=2097152) would exceed memory (size=1048576) :: "
        "#allocation3 [shape = 'u8[2097152]{0}', space=smem, size = 0x200000, scoped, tag = "
        "'prefetched SMEM operand 0'] :: splash_mqa_fwd_residuals.3")


@pytest.mark.parametrize("text,memory,need,have,program,buffer", [
    (HBM, "HBM", int(806.42 * 2**30), int(95.74 * 2**30), "the train step",
     "its temporaries and arguments"),
    (HBM_TEMPORARIES, "HBM", int(33.47 * 2**30), int(15.75 * 2**30), "the train step",
     "its temporaries and arguments"),
    (VMEM, "scoped VMEM", int(16.25 * 2**20), 16 * 2**20, "the train step's fusion fusion.456",
     "its f32[4,8,4,8192] output"),
    (SMEM, "SMEM", 2097152, 1048576, "the train step's kernel splash_mqa_fwd_residuals.3",
     "prefetched SMEM operand 0 (u8[2097152]{0})"),
], ids=["hbm", "hbm-temporaries", "vmem", "smem"])
def test_each_kind_of_out_of_memory_does_not_fit(text, memory, need, have, program, buffer):
    out = _out_of_memory(jax.errors.JaxRuntimeError(text), ARGS)
    assert out["fits"] is False and out["argument_bytes"] == 4 * 1024 * 4
    assert (out["memory"], out["needed_bytes"], out["available_bytes"]) == (memory, need, have)
    assert (out["program"], out["buffer"]) == (program, buffer)
    assert out["note"] == (f"does not fit: {need:,} bytes of {memory} needed, {have:,} "
                           f"available ({program}, {buffer})")


def test_hbm_out_of_memory_reports_the_compilers_temporaries():
    out = _out_of_memory(jax.errors.JaxRuntimeError(HBM), ARGS)
    assert out["device_temp_bytes"] == int(802.96 * 2**30)
    out = _out_of_memory(jax.errors.JaxRuntimeError(HBM_TEMPORARIES), ARGS)
    assert out["device_temp_bytes"] == int(33.47 * 2**30)


def test_other_compile_errors_propagate():
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL: something else"):
        _out_of_memory(jax.errors.JaxRuntimeError("INTERNAL: something else"), ARGS)
