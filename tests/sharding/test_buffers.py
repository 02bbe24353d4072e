"""The peak of a compiled program's temp memory, from dumps written the way XLA writes them:
the sweep over live ranges against a hand count, and the values named by their JAX ops."""

from sharding.buffers import peak
import pytest

pytestmark = pytest.mark.multi_device

ASSIGNMENT = """BufferAssignment:
allocation 0: size 4096, parameter 0, shape |f32[1024]| at ShapeIndex {}:
 value: <0 p @0> (size=4096,offset=0): f32[1024]{0}
allocation 1: size 3072, page 0, preallocated-temp:
 value: <1 a @0> (size=1024,offset=0): f32[256]{0}
 value: <2 b @0> (size=2048,offset=1024): f32[512]{0}
 value: <3 c{0} @0> (size=512,offset=0): f32[128]{0}
 value: <4 d @0> (size=1536,offset=1024): f32[384]{0}
allocation 2: size 8192, color 1, page 0, preallocated-temp:
 value: <5 v @1> (size=8192,offset=0): f32[2048]{0:S(1)}
"""
# a lives 1-3, b 2-4, c{0} 4-6, d 5-6: live bytes 1024, 3072, 3072, 2560, 2048, 2048 at 1..6;
# the peak is at tick 2 (a and b), 3,072 bytes. The VMEM value and the parameter do not count.
LIVE_RANGE = """HloLiveRange (max 7):
  InstructionSequence:
    0:p
  BufferLiveRange:
    p{}:0-7
    a{}:1-3
    b{}:2-4
    c{0}:4-6
    d{}:5-6
    v{}:1-6
  Live ranges at 7 (peak):
"""
HLO = """HloModule jit_step
ENTRY %main {
  %a = f32[256]{0} sine(%p), metadata={op_name="jit(step)/sin" stack_frame_id=1}
  ROOT %b = f32[512]{0} concatenate(%a, %a), metadata={op_name="jit(step)/concatenate"}
}
"""


def test_the_peak_is_the_most_bytes_live_at_once(tmp_path):
    stem = tmp_path / "module_0002.jit_step.cl_1.after_optimizations"
    (tmp_path / (stem.name + "-buffer-assignment.txt")).write_text(ASSIGNMENT)
    (tmp_path / (stem.name + "-live-range.txt")).write_text(LIVE_RANGE)
    (tmp_path / (stem.name + ".txt")).write_text(HLO)
    result = peak(tmp_path)
    assert (result.bytes, result.allocation_bytes) == (3072, 3072)
    assert [(b.name, b.bytes, b.op) for b in result.buffers] == [
        ("b{}", 2048, "jit(step)/concatenate"), ("a{}", 1024, "jit(step)/sin")]
    lines = result.render().splitlines()
    assert "the largest 2 of 2 buffers" in lines[0]
    assert lines[1].split() == ["0.0", "MiB", "f32[512]", "jit(step)/concatenate"]


def test_a_missing_dump_says_what_to_do(tmp_path):
    import pytest

    with pytest.raises(FileNotFoundError, match="dump_flags"):
        peak(tmp_path)
