"""An engine among others: `generation.py` the interface the RL loop talks to, in-process or
remote; `client.py` a `jaxrl serve` process as one; `replicas.py` data-parallel engines behind
one, placed by `router.py`; `join.py` a server offering itself to a trainer's fleet.

Imports: serving.weights and below (a client pushes weights); never serving.frontends.
"""
