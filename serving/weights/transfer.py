"""Weights device to device: the `jax.experimental.transfer` path of a weight update.

The trainer offers its weights (each tensor on one of its devices, in the serving dtype) on a
transfer server of its own, under a random 64-bit id, and calls the generation server's
`PullWeights` RPC with that id, its address and every tensor's name, shape and dtype. The server
checks them against its model exactly as it checks a streamed update (token, version, every
tensor once, shapes, dtypes) before pulling anything, then pulls the tensors straight into its
device memory (on GPU and TPU without a trip through either host's Python) and swaps them in
between two decode steps as it swaps streamed weights.

The gRPC stream (serving/fleet/client.py: weight_pieces) stays the portable default: it needs
nothing but the gRPC port. This path needs the servers to reach the trainer's transfer address,
which has no authentication of its own: the offer's id is its only secret, so use it on a trusted
network only. An offer nobody pulls is dropped at its deadline.
"""

from __future__ import annotations

import datetime
import secrets
import threading

import jax
import numpy as np

from serving.weights.weight_stream import dtype_problem
from sharding.reshard import WeightUpdateError, adapter_hint, missing_names


class Endpoint:
    """This process's transfer server on one device's client (started once per bind host)."""

    _lock = threading.Lock()
    _started: dict[tuple, "Endpoint"] = {}

    def __init__(self, device, host: str):
        from jax.experimental import transfer

        self.device = device
        self.server = transfer.start_transfer_server(device.client, f"{host}:0", [f"{host}:0"])
        self.address = self.server.address()
        self._connections: dict[str, object] = {}

    @classmethod
    def get(cls, device=None, host: str = "127.0.0.1") -> "Endpoint":
        device = device or jax.local_devices()[0]
        with cls._lock:
            key = (device.id, host)
            if key not in cls._started:
                cls._started[key] = cls(device, host)
            return cls._started[key]

    def offer(self, named: dict[str, jax.Array | np.ndarray], deadline_s: float) -> int:
        """Puts every tensor of `named` ({name: array}, in order) on this endpoint's device and
        offers them for one pull within `deadline_s`; returns the offer's id."""
        uuid = secrets.randbits(63)
        arrays = [jax.device_put(x, self.device) for x in named.values()]
        self.server.await_pull(uuid, arrays, timeout=_deadline(deadline_s))
        return uuid

    def pull(self, address: str, uuid: int, specs: list[tuple[str, tuple, str]],
             timeout_s: float | None) -> dict[str, jax.Array]:
        """The offer `uuid` of the transfer server at `address`, onto this endpoint's device."""
        with self._lock:
            connection = self._connections.get(address)
            if connection is None:
                connection = self._connections[address] = self.server.connect(address)
        sharding = jax.sharding.SingleDeviceSharding(self.device)
        wanted = [jax.ShapeDtypeStruct(shape, np.dtype(jax.numpy.dtype(dtype)),
                                       sharding=sharding) for _, shape, dtype in specs]
        kwargs = {} if timeout_s is None else {"timeout": _deadline(timeout_s)}
        arrays = connection.pull(uuid, wanted, **kwargs)
        return {name: a for (name, _, _), a in zip(specs, arrays)}


def _deadline(seconds: float) -> datetime.datetime:
    return datetime.datetime.now() + datetime.timedelta(seconds=seconds)


def check_specs(specs: list[tuple[str, tuple, str]], shapes: dict[str, tuple],
                quantized: dict | None = None) -> None:
    """A pull's tensors against the served model's ({name: shape}): every tensor exactly once,
    each with the model's shape and a floating dtype. Raises WeightUpdateError naming the first
    that is not."""
    seen = set()
    for name, shape, dtype in specs:
        if name not in shapes:
            raise WeightUpdateError(f"weight pull: {name!r} is not a parameter of the served "
                                    f"model{adapter_hint([name])}")
        if name in seen:
            raise WeightUpdateError(f"weight pull: {name} is offered twice")
        seen.add(name)
        if tuple(shape) != tuple(shapes[name]):
            raise WeightUpdateError(f"weight pull: {name} has shape {list(shape)}; the served "
                                    f"model needs {list(shapes[name])}")
        problem = dtype_problem(name, dtype, quantized or {})
        if problem:
            raise WeightUpdateError(f"weight pull: {name}: {problem}")
    missing = missing_names(shapes, seen)
    if missing:
        raise WeightUpdateError(f"weight pull is incomplete: no {missing[0]}"
                                + (f" (and {len(missing) - 1} more tensors)"
                                   if len(missing) > 1 else ""))


def as_tree(named: dict[str, object]) -> dict:
    """{"a/b": x} -> {"a": {"b": x}}."""
    tree: dict = {}
    for name, x in named.items():
        *parents, leaf = name.split("/")
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = x
    return tree
