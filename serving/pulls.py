"""The server's side of the pull paths of a weight update (`PullWeights`): where the bytes
come from (serving/transfer.py: device to device; serving/bulk.py: plain TCP, relayed on when
asked) and the memory a tcp pull receives into (serving/slabs.py: reused once nothing holds it,
which on a CPU device includes the engine serving straight from it).
"""

from __future__ import annotations

from serving import bulk
from serving.bulk_pull import pull
from serving.slabs import ReceivePool


class Pulls:
    """`host`: where this server's transfer and bulk servers bind; `device_of()`: the device a
    jax transfer pull lands on."""

    def __init__(self, host: str, device_of):
        self.host, self._device_of = host, device_of
        self._pool = ReceivePool()

    def bulk_server(self) -> bulk.BulkServer:
        return bulk.BulkServer.get(self.host)

    def pull(self, request, specs, timeout_s, apply):
        """Pulls the update `request` names, then `apply(named)`s it; what `apply` returns."""
        if request.transport != "tcp":
            from serving.transfer import Endpoint

            endpoint = Endpoint.get(self._device_of(), host=self.host)
            return apply(endpoint.pull(request.address, request.uuid, specs, timeout_s))
        into, slab = self._pool.take(specs)
        relay = None
        if request.relay_uuid:
            relay = bulk.relay_offer(self.bulk_server(), request.relay_uuid, into, timeout_s,
                                     slab)
        return apply(pull(request.address, request.uuid, specs, timeout_s, into, relay))
