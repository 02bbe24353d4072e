"""The server's side of the pull paths of a weight update (`PullWeights`): where the bytes
come from (serving/transfer.py: device to device; serving/bulk.py: plain TCP, relayed on when
asked) and the receive arrays a tcp pull fills, kept from one update to the next.

A tcp pull receives into the arrays of an earlier one when they are free: given back once the
engine has copied them in, and, when the pull relayed them, once the relay has been sent (or
has expired). Fresh pages cost a fault each, which on some hosts is most of a pull's time.
"""

from __future__ import annotations

import threading

import jax

from serving import bulk


class Pulls:
    """`params()`: the weights the engine serves now (their copies out of the receive arrays
    finish before those are reused); `host`: where this server's transfer and bulk servers
    bind."""

    def __init__(self, params, host: str, device_of):
        self._params, self.host, self._device_of = params, host, device_of
        self._pool = bulk.ReceivePool()

    def bulk_server(self) -> bulk.BulkServer:
        return bulk.BulkServer.get(self.host)

    def pull(self, request, specs, timeout_s, apply):
        """Pulls the update `request` names, then `apply(named)`s it; what `apply` returns."""
        if request.transport != "tcp":
            from serving.transfer import Endpoint

            endpoint = Endpoint.get(self._device_of(), host=self.host)
            return apply(endpoint.pull(request.address, request.uuid, specs, timeout_s))
        into = self._pool.take(specs)
        relay = None
        if request.relay_uuid:
            relay = bulk.relay_offer(self.bulk_server(), request.relay_uuid, into, timeout_s)
        try:
            named = bulk.pull(request.address, request.uuid, specs, timeout_s, into, relay)
            return apply(named)
        finally:
            self._give_back(specs, into, relay)

    def _give_back(self, specs, arrays, relay: bulk.Offer | None) -> None:
        """`arrays` back to the pool once nothing reads them: the engine's copy in done, and a
        relay sent (or expired), waited for on a thread of its own."""
        def back():
            while relay is not None and not relay.released():
                relay.done.wait(1.0)
            jax.block_until_ready(self._params())
            self._pool.give_back(specs, arrays)

        if relay is None:
            back()
        else:
            threading.Thread(target=back, name="bulk-give-back", daemon=True).start()
