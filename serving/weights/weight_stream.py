"""Weights arriving as a stream of pieces (`WeightPiece`: tensor name, shape, dtype, byte offset,
bytes), assembled into a tree only once every check has passed.

Checks, each before anything that depends on it:
- the version is the same on every piece and newer than the one served (unless every piece says
  `resume`: a trainer resumed from a checkpoint restarts the sequence at its own version);
- a tensor's name is one of the served model's, its declared shape is that parameter's shape
  and its dtype a wire dtype (floating, or int8/fp8 for quantized weights): all before its
  buffer is allocated, so a hostile shape allocates nothing;
- a tensor's shape and dtype are the same on every piece of it;
- the pieces of a tensor tile it exactly: none starts outside it or runs past its end, none
  overlaps another (both byte ranges named), and when the stream ends none is missing (the first
  gap named), and every tensor of the model is present.
Any failure raises WeightUpdateError naming the tensor and the byte range; nothing is returned,
so nothing is applied.
"""

from __future__ import annotations

import bisect
import math

import jax
import ml_dtypes
import numpy as np

from serving.core.requests import StaleVersion
from sharding.reshard import WeightUpdateError, adapter_hint, missing_names

# int8 and float8_e4m3fn: a quantized model's projections (model.quantize), and only those.
WIRE_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16,
               "int8": np.int8, "float8_e4m3fn": ml_dtypes.float8_e4m3fn}
QUANTIZED_WIRE = ("int8", "float8_e4m3fn")
FLOAT_WIRE = ("float32", "bfloat16", "float16")


def dtype_problem(name: str, dtype: str, quantized: dict) -> str | None:
    """Why wire dtype `dtype` cannot carry tensor `name`, or None: a weight the served model
    holds in 8 bits (`quantized`: {name: dtype}) comes in that dtype, any other in a floating
    one."""
    if name in quantized:
        held = quantized[name]
        return None if dtype == held else \
            f"dtype {dtype!r}; the served model holds it as {held} (quantized)"
    return None if dtype in FLOAT_WIRE else f"dtype {dtype!r} is not one of {', '.join(FLOAT_WIRE)}"


def check_version(version: int, resume: bool, current: int) -> None:
    """An update's version: newer than the one served, unless it says `resume` (a trainer
    resumed from an older checkpoint), and never negative."""
    if version <= current and not resume:
        raise StaleVersion(f"weight update version {version} is not newer than the served "
                           f"version {current}")
    if version < 0:
        raise WeightUpdateError(f"weight update version {version} must be >= 0")


def _wire_name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def tensor_names(target) -> dict[str, tuple[int, ...]]:
    """{"layers/q_proj": shape, ...} of a tree of arrays or ShapeDtypeStructs."""
    return {_wire_name(path): tuple(x.shape)
            for path, x in jax.tree_util.tree_flatten_with_path(target)[0]}


def quantized_names(target) -> dict[str, str]:
    """{wire name: dtype} of a tree's 8-bit (quantized) tensors."""
    return {_wire_name(path): np.dtype(x.dtype).name
            for path, x in jax.tree_util.tree_flatten_with_path(target)[0]
            if np.dtype(x.dtype).name in QUANTIZED_WIRE}


class _Tensor:
    """One tensor's buffer and the byte ranges written into it, kept sorted and disjoint."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype: np.dtype):
        self.name, self.shape, self.dtype = name, shape, dtype
        self.buffer = bytearray(math.prod(shape) * dtype.itemsize)
        self.starts: list[int] = []
        self.ends: list[int] = []

    def write(self, offset: int, data: bytes) -> None:
        end = offset + len(data)
        if offset < 0 or end > len(self.buffer) or (not data and len(self.buffer)):
            raise WeightUpdateError(f"weight update: {self.name}: piece of bytes [{offset}, {end})"
                                    f" lies outside the tensor's {len(self.buffer)} bytes")
        i = bisect.bisect_right(self.starts, offset)
        for j in (i - 1, i):   # the neighbours that could overlap [offset, end)
            if 0 <= j < len(self.starts) and self.starts[j] < end and offset < self.ends[j] \
                    and offset < end:
                raise WeightUpdateError(
                    f"weight update: {self.name}: piece of bytes [{offset}, {end}) overlaps the "
                    f"piece of bytes [{self.starts[j]}, {self.ends[j]})")
        self.starts.insert(i, offset)
        self.ends.insert(i, end)
        self.buffer[offset:end] = data

    def first_gap(self) -> tuple[int, int] | None:
        covered = 0
        for start, end in zip(self.starts, self.ends):
            if start > covered:
                return covered, start
            covered = max(covered, end)
        return (covered, len(self.buffer)) if covered < len(self.buffer) else None

    def array(self) -> np.ndarray:
        return np.frombuffer(bytes(self.buffer), self.dtype).reshape(self.shape)


class WeightAssembler:
    """Assembles one update for a model whose parameters are `shapes` ({name: shape}), those
    named in `quantized` held in 8 bits ({name: dtype}), served at `current_version`. `add`
    each piece, then
    `finish` for (version, tree)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], current_version: int,
                 quantized: dict | None = None):
        self.shapes, self.quantized = shapes, quantized or {}
        self.current_version = current_version
        self.version: int | None = None
        self.resume = False
        self.tensors: dict[str, _Tensor] = {}

    def add(self, piece) -> None:
        self._check_version(piece.version, getattr(piece, "resume", False))
        shape, dtype = tuple(piece.shape), piece.dtype
        tensor = self.tensors.get(piece.name)
        if tensor is None:
            if piece.name not in self.shapes:
                raise WeightUpdateError(f"weight update: {piece.name!r} is not a parameter of "
                                        f"the served model{adapter_hint([piece.name])}")
            if shape != self.shapes[piece.name]:
                raise WeightUpdateError(f"weight update: {piece.name} declared shape {shape}; "
                                        f"the served model needs {self.shapes[piece.name]}")
            problem = dtype_problem(piece.name, dtype, self.quantized)
            if problem:
                raise WeightUpdateError(f"weight update: {piece.name}: {problem}")
            tensor = self.tensors[piece.name] = _Tensor(piece.name, shape,
                                                        np.dtype(WIRE_DTYPES[dtype]))
        elif shape != tensor.shape or np.dtype(WIRE_DTYPES.get(dtype, object)) != tensor.dtype:
            raise WeightUpdateError(f"weight update: {piece.name}: a piece declares {shape} "
                                    f"{dtype}, an earlier one {tensor.shape} {tensor.dtype}")
        tensor.write(piece.offset, piece.data)

    def _check_version(self, version: int, resume: bool) -> None:
        if self.version is None:
            check_version(version, resume, self.current_version)
            self.version, self.resume = version, resume
        elif version != self.version or resume != self.resume:
            raise WeightUpdateError(f"weight update: pieces of one update carry versions "
                                    f"{self.version} and {version} (resume {self.resume} and "
                                    f"{resume})")

    def finish(self) -> tuple[int, dict]:
        if self.version is None:
            raise WeightUpdateError("weight update carried no tensors")
        missing = missing_names(self.shapes, self.tensors)
        if missing:
            raise WeightUpdateError(f"weight update is incomplete: no piece of {missing[0]}"
                                    + (f" (and {len(missing) - 1} more tensors)"
                                       if len(missing) > 1 else ""))
        for tensor in self.tensors.values():
            gap = tensor.first_gap()
            if gap is not None:
                raise WeightUpdateError(f"weight update is incomplete: {tensor.name} has no "
                                        f"bytes [{gap[0]}, {gap[1]}) of its "
                                        f"{len(tensor.buffer)}")
        tree: dict = {}
        for name, tensor in self.tensors.items():
            *parents, leaf = name.split("/")
            node = tree
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = tensor.array()
        return self.version, tree


def assemble_weights(pieces, shapes: dict[str, tuple[int, ...]], current_version: int
                     ) -> tuple[int, dict]:
    """(version, tree of numpy arrays) from a stream of pieces, every check passed."""
    assembler = WeightAssembler(shapes, current_version)
    for piece in pieces:
        assembler.add(piece)
    return assembler.finish()
