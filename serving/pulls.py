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


def stages(device) -> bool:
    """Whether a tcp pull onto `device` goes through a few chunks of host memory
    (serving/staging.py) rather than a slab the size of the model: on any device but a CPU,
    whose engine serves from the slab itself."""
    return device.platform != "cpu"


class Pulls:
    """`host`: where this server's transfer and bulk servers bind; `device_of()`: the device a
    jax transfer pull, and a staged tcp pull, lands on."""

    def __init__(self, host: str, device_of):
        self.host, self._device_of = host, device_of
        self._pool = ReceivePool.shared()

    def bulk_server(self) -> bulk.BulkServer:
        return bulk.BulkServer.get(self.host)

    def pull(self, request, specs, timeout_s, apply):
        """Pulls the update `request` names, checks it for NaN/Inf (unless a relay it mapped
        vouches for it), then `apply(named)`s it; what `apply` returns. The relay a tcp pull
        makes vouches for it in turn once checked."""
        if request.transport != "tcp":
            from serving.transfer import Endpoint

            endpoint = Endpoint.get(self._device_of(), host=self.host)
            named = endpoint.pull(request.address, request.uuid, specs, timeout_s)
            require_finite(list(named.items()))
            return apply(named)
        relay = None
        if request.relay_uuid:
            relay = bulk.relay_offer(self.bulk_server(), request.relay_uuid, nbytes(specs),
                                     timeout_s)
        device = self._device_of()
        named, vouched = pull(request.address, request.uuid, specs, timeout_s,
                              lambda: self._pool.take(specs), relay,
                              onto=device if stages(device) else None)
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
