"""Streamed weight updates are checked piece by piece: every hostile stream is refused with the
tensor and byte range named, before it allocates anything it should not, and nothing of it is
returned (so nothing is applied); a good stream in any piece order assembles exactly."""

import numpy as np
import pytest

from serving.fleet.client import weight_pieces
from serving.proto import generation_pb2 as gen
from serving.weights.weight_stream import (
    WIRE_DTYPES,
    StaleVersion,
    WeightAssembler,
    assemble_weights,
    tensor_names,
)
from sharding.reshard import WeightUpdateError

PARAMS = {"embed": np.arange(32, dtype=np.float32).reshape(8, 4),
          "layers": {"q_proj": np.linspace(-1, 1, 24, dtype=np.float32).reshape(2, 3, 4)},
          "final_norm": np.ones(4, np.float32)}
SHAPES = tensor_names(PARAMS)


def pieces(version=5, piece_bytes=40, params=PARAMS):
    return list(weight_pieces(params, version, piece_bytes=piece_bytes))


def piece(name="embed", offset=0, data=b"\0" * 4, shape=(8, 4), dtype="float32", version=5):
    return gen.WeightPiece(version=version, name=name, shape=shape, dtype=dtype, offset=offset,
                           data=data)


def test_names_are_the_tree_paths():
    assert SHAPES == {"embed": (8, 4), "layers/q_proj": (2, 3, 4), "final_norm": (4,)}


def test_a_good_stream_in_any_order_assembles_exactly():
    stream = pieces()
    rng = np.random.default_rng(0)
    for order in (stream, [stream[i] for i in rng.permutation(len(stream))]):
        version, tree = assemble_weights(order, SHAPES, current_version=4)
        assert version == 5
        for name in ("embed", "final_norm"):
            np.testing.assert_array_equal(tree[name], PARAMS[name])
        np.testing.assert_array_equal(tree["layers"]["q_proj"], PARAMS["layers"]["q_proj"])


def _refused(stream, message, current_version=4, error=WeightUpdateError):
    with pytest.raises(error, match=message):
        assemble_weights(stream, SHAPES, current_version)


def test_a_gap_is_refused_with_its_byte_range():
    stream = [p for p in pieces() if not (p.name == "embed" and p.offset == 40)]
    _refused(stream, r"incomplete: embed has no bytes \[40, 80\) of its 128")


def test_a_stream_cut_inside_the_last_tensor_is_refused():
    stream = pieces(piece_bytes=8)
    _refused(stream[:-1], r"incomplete: layers/q_proj has no bytes \[88, 96\) of its 96")


def test_a_missing_tensor_is_refused():
    _refused([p for p in pieces() if p.name != "layers/q_proj"],
             "incomplete: no piece of layers/q_proj")


@pytest.mark.parametrize("offset, size, other", [(0, 40, "[0, 40)"), (36, 8, "[0, 40)"),
                                                 (20, 40, "[0, 40)"), (76, 8, "[40, 80)")])
def test_overlapping_pieces_are_refused_naming_both_ranges(offset, size, other):
    stream = pieces()
    stream.insert(3, piece(offset=offset, data=b"\1" * size))
    _refused(stream, rf"embed: piece of bytes \[{offset}, {offset + size}\) overlaps the piece "
                     rf"of bytes \[{other[1:-1]}\)")


@pytest.mark.parametrize("offset, size", [(-4, 8), (124, 8), (200, 4), (0, 0)])
def test_a_piece_outside_its_tensor_is_refused(offset, size):
    _refused([piece(offset=offset, data=b"\0" * size)],
             rf"embed: piece of bytes \[{offset}, {offset + size}\) lies outside the tensor's "
             r"128 bytes")


@pytest.mark.parametrize("shape", [(2**40,), (2**26,), (8, 5), ()])
def test_a_wrong_declared_shape_is_refused_before_any_allocation(shape):
    assembler = WeightAssembler(SHAPES, current_version=4)
    with pytest.raises(WeightUpdateError, match=r"embed declared shape .* the served model "
                                                r"needs \(8, 4\)"):
        assembler.add(piece(shape=shape))
    assert assembler.tensors == {}     # no buffer was made for it


def test_unknown_tensors_bad_dtypes_and_changing_declarations_are_refused():
    _refused([piece(name="lm_head")], "'lm_head' is not a parameter of the served model")
    _refused([piece(dtype="int8")], "embed: dtype 'int8' is not one of float32, bfloat16")
    _refused([piece(dtype="float8_e4m3fn")], "embed: dtype 'float8_e4m3fn' is not one of "
                                             "float32, bfloat16")
    _refused([piece(), piece(offset=4, dtype="bfloat16", data=b"\0\0")],
             r"embed: a piece declares \(8, 4\) bfloat16, an earlier one \(8, 4\) float32")
    _refused([], "carried no tensors")


@pytest.mark.parametrize("held", ["int8", "float8_e4m3fn"])
def test_an_8_bit_weight_comes_in_its_dtype_and_a_float_one_as_a_float(held):
    """A quantized model's 8-bit projections (model.quantize) are sent in their own dtype; a
    float sent for one, the other 8-bit dtype, or an 8-bit one for a float weight, is refused
    before anything is allocated."""
    assembler = WeightAssembler(SHAPES, current_version=4, quantized={"embed": held})
    other = "int8" if held != "int8" else "float8_e4m3fn"
    for dtype in ("float32", other):
        with pytest.raises(WeightUpdateError, match=rf"embed: dtype '{dtype}'; the served "
                                                    rf"model holds it as {held}"):
            assembler.add(piece(dtype=dtype, data=b"\1" * 32))
    assert assembler.tensors == {}
    assembler.add(piece(dtype=held, data=b"\1" * 32))         # 8 x 4 bytes: the whole tensor
    assert assembler.tensors["embed"].dtype == WIRE_DTYPES[held]


def test_versions_must_be_one_per_update_and_newer_than_the_served_one():
    _refused([piece(), piece(offset=4, version=6)], "carry versions 5 and 6")
    _refused(pieces(version=7), "version 7 is not newer than the served version 7",
             current_version=7, error=StaleVersion)
    _refused(pieces(version=0), "version 0 is not newer than the served version 7",
             current_version=7, error=StaleVersion)


def test_a_resume_update_may_go_back_and_says_so_on_every_piece():
    """A trainer resumed from a checkpoint brings a server back to its own, older version."""
    stream = list(weight_pieces(PARAMS, 3, piece_bytes=40, resume=True))
    assembler = WeightAssembler(SHAPES, current_version=9)
    for p in stream:
        assembler.add(p)
    version, tree = assembler.finish()
    assert (version, assembler.resume) == (3, True)
    np.testing.assert_array_equal(tree["embed"], PARAMS["embed"])
    mixed = stream[:1] + pieces(version=3)[1:]
    _refused(mixed, r"resume True and False", current_version=2)
    _refused(list(weight_pieces(PARAMS, -2, resume=True)), "version -2 must be >= 0",
             current_version=9)
