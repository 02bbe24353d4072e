"""The commands behind `jaxrl` (jaxrl/cli.py parses, these run): `job` (`jaxrl train`: the
warm-up, then RL, one summary), `serve` (`jaxrl serve`: a checkpoint behind gRPC and the
OpenAI-compatible HTTP API), `compile` (`jaxrl compile`: ahead-of-time compiles and memory
reports for a TPU topology) and `bench` (`jaxrl bench`: the benchmarks under bench/).

The top of the package: may import any part of jaxrl, serving and sharding; only jaxrl.api
and jaxrl.cli import it (tests/test_layering.py)."""
