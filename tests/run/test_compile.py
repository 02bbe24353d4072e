"""`jaxrl compile` reports every compiler out-of-memory as "does not fit", with the compiler's
own figure, and lets other compile errors through."""

import jax
import jax.numpy as jnp
import pytest

from jaxrl.commands.compile import _out_of_memory

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


def test_vmem_out_of_memory_does_not_fit():
    out = _out_of_memory(jax.errors.JaxRuntimeError(VMEM), ARGS)
    assert out["fits"] is False and out["argument_bytes"] == 4 * 1024 * 4
    assert (out["vmem_bytes"], out["vmem_limit_bytes"]) == (int(16.25 * 2**20), 16 * 2**20)
    assert "16.25 MiB of scoped VMEM, over the 16.00 MiB limit" in out["note"]


def test_hbm_out_of_memory_does_not_fit():
    out = _out_of_memory(jax.errors.JaxRuntimeError(HBM), ARGS)
    assert out["fits"] is False and out["device_temp_bytes"] == int(802.96 * 2**30)


def test_other_compile_errors_propagate():
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL: something else"):
        _out_of_memory(jax.errors.JaxRuntimeError("INTERNAL: something else"), ARGS)
