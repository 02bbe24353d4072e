"""The server's side of the pull paths of a weight update (`PullWeights`): where the bytes
come from (serving/transfer.py: device to device; serving/bulk.py: plain TCP, relayed on when
asked) and the memory a tcp pull receives into (serving/slabs.py: reused once nothing holds it,
which on a CPU device includes the engine serving straight from it; none at all when a relay on
this host hands over a slab of its own).
"""

from __future__ import annotations

from serving import bulk
from serving.bulk_pull import pull
from serving.slabs import ReceivePool, nbytes
from sharding.reshard import WeightUpdateError, require_finite


class Pulls:
    """`host`: where this server's transfer and bulk servers bind; `device_of()`: the device a
    jax transfer pull lands on."""

    def __init__(self, host: str, device_of):
        self.host, self._device_of = host, device_of
        self._pool = ReceivePool.shared()

    def bulk_server(self) -> bulk.BulkServer:
        return bulk.BulkServer.get(self.host)

    def pull(self, request, specs, timeout_s, apply):
        """Pulls the update `request` names, then `apply(named, finite_checked)`s it; what
        `apply` returns. A tcp pull is checked for NaN/Inf here (or vouched for by the relay
        it mapped), before the relay it makes vouches for it in turn."""
        if request.transport != "tcp":
            from serving.transfer import Endpoint

            endpoint = Endpoint.get(self._device_of(), host=self.host)
            return apply(endpoint.pull(request.address, request.uuid, specs, timeout_s), False)
        relay = None
        if request.relay_uuid:
            relay = bulk.relay_offer(self.bulk_server(), request.relay_uuid, nbytes(specs),
                                     timeout_s)
        named, vouched = pull(request.address, request.uuid, specs, timeout_s,
                              lambda: self._pool.take(specs), relay)
        try:
            if not vouched:
                require_finite(list(named.items()))
        except WeightUpdateError as e:
            if relay is not None:
                relay.fail(str(e))
            raise
        if relay is not None:
            relay.vouch()
        return apply(named, True)
