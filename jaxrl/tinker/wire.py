"""The Tinker API's binary bodies (wire.proto) to and from plain arrays.

A forward_backward request arrives as protobuf, zstd-compressed when the client was told to
(`Content-Encoding: zstd`); its results, and sample results, go back as protobuf when the client
sends `Accept: application/x-protobuf` (the SDK always does for these two). Everything else in
the API is JSON (jaxrl/tinker/app.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxrl.tinker import wire_pb2 as pb

_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


class WireError(ValueError):
    """A body that does not decode, or names what the API does not have; the client's fault."""


@dataclasses.dataclass(frozen=True)
class Datum:
    tokens: np.ndarray                 # int32 [N]: the model input, its text chunks joined
    inputs: dict[str, np.ndarray]      # loss_fn_inputs, each dense


@dataclasses.dataclass(frozen=True)
class ForwardBackward:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float]
    forward_only: bool
    data: list[Datum]


def decode_forward_backward(body: bytes, encoding: str | None = None) -> ForwardBackward:
    if encoding == "zstd":
        import zstandard

        try:
            body = zstandard.ZstdDecompressor().decompress(body, max_output_size=1 << 31)
        except zstandard.ZstdError as e:
            raise WireError(f"the body is not zstd ({e})") from None
    elif encoding not in (None, "", "identity"):
        raise WireError(f"Content-Encoding {encoding!r}: zstd or none")
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # protobuf's DecodeError, or a message from the wrong schema
        raise WireError(f"the body is not a ForwardBackwardRequest ({e})") from None
    config = {k: v for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        if v.WhichOneof("value") == "text":
            raise WireError(f"loss_fn_config[{k!r}] = {v.text!r}: jaxrl's losses take numbers")
        config[k] = v.number
    return ForwardBackward(msg.model_id, msg.seq_id, msg.loss_fn, config, msg.forward_only,
                           [_datum(i, d) for i, d in enumerate(msg.data)])


def _datum(i: int, d) -> Datum:
    parts = []
    for chunk in d.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise WireError(f"datum {i}: a {kind} chunk; this service takes text tokens only")
        parts.append(np.frombuffer(chunk.encoded_text.tokens, np.int32))
    tokens = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    return Datum(tokens, {k: tensor(v, f"datum {i} {k}") for k, v in d.loss_fn_inputs.items()})


def tensor(t, what: str) -> np.ndarray:
    """A wire Tensor as a dense numpy array (sparse CSR expanded)."""
    dtype = _NUMPY.get(t.dtype)
    if dtype is None:
        raise WireError(f"{what}: dtype {t.dtype} (float32, int64 or int32)")
    shape = tuple(t.shape)
    try:
        if t.WhichOneof("encoding") == "sparse_csr":
            rows = np.frombuffer(t.sparse_csr.crow_indices, np.int64)
            cols = np.frombuffer(t.sparse_csr.col_indices, np.int64)
            values = np.frombuffer(t.sparse_csr.values, dtype)
            dense = np.zeros(shape, dtype)
            flat = dense.reshape(len(rows) - 1, -1) if len(shape) != 1 else dense[None]
            for r in range(len(rows) - 1):
                flat[r, cols[rows[r]:rows[r + 1]]] = values[rows[r]:rows[r + 1]]
            return dense
        values = np.frombuffer(t.dense, dtype)
        return values.reshape(shape) if shape else values
    except (ValueError, IndexError) as e:
        raise WireError(f"{what}: {e}") from None


def encode_forward_backward(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]
                            ) -> bytes:
    """One ArrayRecord holding every datum's outputs (each a 1-D float32 array per field)."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    msg.metrics.update(metrics)
    record = msg.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(outputs))
    for name in (outputs[0] if outputs else {}):
        arrays = [np.ascontiguousarray(o[name], np.float32) for o in outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64)
        field = record.fields[name]
        field.data = b"".join(a.tobytes() for a in arrays)
        field.offsets = offsets.tobytes()
        field.dtype = pb.DTYPE_FLOAT32
    return msg.SerializeToString()


@dataclasses.dataclass(frozen=True)
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    stop: bool                          # False: it ran to max_tokens


def encode_sample(sequences: list[Sequence], prompt_logprobs: list[float] | None) -> bytes:
    msg = pb.SampleResponse()
    for s in sequences:
        seq = msg.sequences.add(stop_reason=pb.STOP_REASON_STOP if s.stop
                                else pb.STOP_REASON_LENGTH)
        seq.tokens = np.asarray(s.tokens, np.int32).tobytes()
        seq.logprobs = np.asarray(s.logprobs, np.float32).tobytes()
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, np.float32).tobytes()
    return msg.SerializeToString()
