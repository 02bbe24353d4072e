"""The Tinker API's bodies for forward_backward and sample, to and from plain arrays.

The SDK (0.18 and later) sends a forward_backward request as protobuf (wire.proto),
zstd-compressed when the client was told to (`Content-Encoding: zstd`), and asks for its
results, and sample results, as protobuf (`Accept: application/x-protobuf`). Earlier SDKs send
and read both as JSON (TensorData: {"data": [...], "dtype", "shape"}); the service answers each
in its own encoding. Everything else in the API is JSON (jaxrl/tinker/app.py).
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


def decode_forward_backward_json(body: dict, forward_only: bool) -> ForwardBackward:
    """A forward(_backward) request as SDKs before 0.18 send it (JSON)."""
    try:
        fb = body["forward_backward_input"]
        data = []
        for i, d in enumerate(fb["data"]):
            tokens = [t for c in d["model_input"]["chunks"] for t in _text_chunk(i, c)]
            inputs = {k: _json_tensor(v, f"datum {i} {k}")
                      for k, v in d.get("loss_fn_inputs", {}).items()}
            data.append(Datum(np.asarray(tokens, np.int32), inputs))
        config = {k: float(v) for k, v in (fb.get("loss_fn_config") or {}).items()}
        return ForwardBackward(str(body["model_id"]), int(body.get("seq_id") or 0),
                               str(fb["loss_fn"]), config, forward_only, data)
    except (KeyError, TypeError, ValueError) as e:
        raise WireError(f"the body is not a forward_backward request ({e!r})") from None


def _text_chunk(i: int, chunk: dict) -> list[int]:
    if chunk.get("type", "encoded_text") != "encoded_text":
        raise WireError(f"datum {i}: a {chunk.get('type')} chunk; this service takes text "
                        f"tokens only")
    return [int(t) for t in chunk["tokens"]]


def _json_tensor(t: dict, what: str) -> np.ndarray:
    dtype = {"float32": np.float32, "int64": np.int64}.get(t.get("dtype"))
    if dtype is None:
        raise WireError(f"{what}: dtype {t.get('dtype')!r} (float32 or int64)")
    values = np.asarray(t["data"], dtype)
    return values.reshape(t["shape"]) if t.get("shape") else values


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


def forward_backward_json(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]
                          ) -> dict:
    tensor = lambda a: {"data": np.asarray(a, np.float32).tolist(), "dtype": "float32",  # noqa: E731
                        "shape": [len(a)]}
    return {"loss_fn_output_type": "ArrayRecord", "metrics": metrics,
            "loss_fn_outputs": [{k: tensor(v) for k, v in o.items()} for o in outputs]}


@dataclasses.dataclass(frozen=True)
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    stop: bool                          # False: it ran to max_tokens


def sample_json(sequences: list[Sequence], prompt_logprobs: list[float] | None) -> dict:
    return {"type": "sample",
            "sequences": [{"stop_reason": "stop" if s.stop else "length", "tokens": s.tokens,
                           "logprobs": s.logprobs} for s in sequences],
            "prompt_logprobs": None if prompt_logprobs is None else
            [None if x != x else x for x in prompt_logprobs]}


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
