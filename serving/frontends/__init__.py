"""How clients reach an engine: `server.py` JetStream's gRPC Orchestrator service (unchanged on
the wire) beside jaxrl's Generation service, with `health.py` gRPC's health service;
`openai_api.py` the OpenAI HTTP API (`openai_schema.py` its request shapes, `openai_choices.py`
and `openai_stream.py` its responses, `tool_calls.py` and `structured.py` tools and structured
outputs, `trajectories.py` its data plane) served by `http_server.py`; `prometheus.py`
metrics; `detokenize.py` text a token at a time.

Imports: serving.weights and below; never serving.fleet.
"""
