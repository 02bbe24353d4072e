"""The server's side of the pull paths of a weight update (`PullWeights`): where the bytes
come from (serving/weights/transfer.py: device to device; serving/weights/bulk.py: plain TCP,
relayed on when asked) and the memory a tcp pull receives into (serving/weights/slabs.py: reused
once nothing holds it, which on a CPU device includes the engine serving straight from it; none at
all when a relay on this host hands over a slab of its own).
"""

from __future__ import annotations

from serving.weights import bulk
from serving.weights.bulk_pull import pull
from serving.weights.slabs import ReceivePool, nbytes
from sharding.reshard import WeightUpdateError, require_finite


def stages(devices: list) -> bool:
    """Whether a tcp pull for weights on `devices` goes through a few chunks of host memory onto
    the device (serving/weights/staging.py) rather than a slab the size of the model: on one GPU or
    TPU. A CPU engine serves from the slab itself; weights sharded over several devices are
    placed from the slab, shard by shard (staged whole onto one device, they might not fit)."""
    return len(devices) == 1 and devices[0].platform != "cpu"


class Pulls:
    """`host`: where this server's transfer and bulk servers bind; `devices_of()`: the devices
    the engine's weights live on (a jax transfer pull lands on the first)."""

    def __init__(self, host: str, devices_of):
        self.host, self._devices_of = host, devices_of
        self._pool = ReceivePool.shared()

    def bulk_server(self) -> bulk.BulkServer:
        return bulk.BulkServer.get(self.host)

    def pull(self, request, specs, timeout_s, apply):
        """Pulls the update `request` names, checks it for NaN/Inf (unless a relay it mapped
        vouches for it), then `apply(named)`s it; what `apply` returns. The relay a tcp pull
        makes vouches for it in turn once checked."""
        if request.transport != "tcp":
            from serving.weights.transfer import Endpoint

            endpoint = Endpoint.get(self._devices_of()[0], host=self.host)
            named = endpoint.pull(request.address, request.uuid, specs, timeout_s)
            require_finite(list(named.items()))
            return apply(named)
        relay = None
        if request.relay_uuid:
            relay = bulk.relay_offer(self.bulk_server(), request.relay_uuid, nbytes(specs),
                                     timeout_s)
        devices = self._devices_of()
        named, vouched = pull(request.address, request.uuid, specs, timeout_s,
                              lambda: self._pool.take(specs), relay,
                              onto=devices[0] if stages(devices) else None)
        try:
            if not vouched:
                require_finite(list(named.items()))
        except WeightUpdateError as e:
            if relay is not None:
                relay.fail(str(e))
            raise
        if relay is not None:
            relay.vouch()
        return apply(named)
