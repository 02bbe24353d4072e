"""The generation service, in rooms by concept (lowest first; a room imports only the rooms
below it, tests/test_layering.py checks):

- `serving.proto`: the wire formats (JetStream's, the Generation and Fleet services), generated.
- `serving.runner`: what runs on the device: the Engine (JetStream's Engine API over a paged
  KV cache), its sizes (EngineConfig), its compiled programs and what each computes, sampling
  and grammars, the paged KV cache and its attention kernels.
- `serving.core`: the host side of the engine: sequences and their streams, the scheduler and
  the page pool, sessions, the engine loop that owns the device, and the Orchestrator, its
  public face (requests checked, weight updates between two steps, metrics).
- `serving.weights`: weights arriving at a server: the gRPC stream, the tcp bulk path with its
  slabs and staging, the jax-transfer pull, and the checks they share.
- `serving.frontends`: how clients reach an engine: JetStream's gRPC service and jaxrl's
  Generation service, the OpenAI HTTP API (tools, structured outputs), health, Prometheus.
- `serving.fleet`: an engine among others: the Generation interface, the remote client,
  replicas and their router, a server joining a trainer's fleet.

docs/design.md draws the map; a decode step is read from `serving/core/engine_loop.py` down.
"""
