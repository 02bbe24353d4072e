"""What probes and scrapers see. gRPC's health service on the server's port, through grpc's own
health stub (what Kubernetes' gRPC probes and grpc_health_probe call): SERVING for the server
and each service by name while the engine runs, NOT_FOUND for another name, and NOT_SERVING to
a watcher once the engine has failed or the server stops. The metrics in Prometheus' text
format, read back by prometheus_client's own parser."""

import threading
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from serving.core.orchestrator import Orchestrator
from serving.frontends import prometheus
from serving.frontends.health import Health
from serving.frontends.server import Server
from serving.runner.sampling import SamplingParams

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _check(channel, service=""):
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=30).status


def test_the_server_answers_grpc_health_checks_and_tells_watchers_it_stops(engine, params):
    server = Server(Orchestrator(engine, params).start(), port=0).start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            for service in ("", "jetstream_proto.Orchestrator", "jaxrl.serving.Generation"):
                assert _check(channel, service) == SERVING, service
            with pytest.raises(grpc.RpcError) as missing:
                _check(channel, "no.such.Service")
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND
            watch = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service=""), timeout=60)
            assert next(watch).status == SERVING
            stopping = threading.Thread(target=server.stop, kwargs={"grace": 5.0})
            stopping.start()
            assert next(watch).status == NOT_SERVING
            stopping.join(60)
            assert not stopping.is_alive()
    finally:
        server.stop(grace=0)


def test_a_failed_engine_is_not_serving():
    """`serving()` turning false (the engine loop's error set) reaches Check at once and a
    watcher within the poll: the watcher's stream, read on a thread, records each status."""
    ok = threading.Event()
    ok.set()
    health = Health(ok.is_set, ["svc"], poll_s=0.01)
    server = grpc.server(futures.ThreadPoolExecutor(4))
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    seen, changed = [], threading.Condition()

    def watch(channel):
        try:
            for reply in health_pb2_grpc.HealthStub(channel).Watch(
                    health_pb2.HealthCheckRequest(service="svc"), timeout=30):
                with changed:
                    seen.append(reply.status)
                    changed.notify_all()
        except grpc.RpcError:       # cancelled when the server stops
            pass

    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            watcher = threading.Thread(target=watch, args=(channel,))
            watcher.start()
            with changed:
                assert changed.wait_for(lambda: seen, 10) and seen == [SERVING]
            assert _check(channel, "svc") == SERVING
            ok.clear()
            assert _check(channel) == NOT_SERVING          # Check reads the engine at once
            with changed:
                assert changed.wait_for(lambda: len(seen) > 1, 10)
            assert seen == [SERVING, NOT_SERVING]
            server.stop(0)
            watcher.join(10)
            assert not watcher.is_alive()
    finally:
        health.stop()
        server.stop(0)


def test_metrics_read_back_by_prometheus_own_parser(orchestrator):
    orchestrator.generate([3, 4, 5], SamplingParams(temperature=0.0, max_tokens=4))
    metrics = orchestrator.metrics()
    text = prometheus.exposition({**metrics, "a name": 1.5, "nan": float("nan"), "flag": True,
                                  "label": "x"})
    families = {f.name: f for f in text_string_to_metric_families(text)}
    done = families["jaxrl_requests_done"]          # the parser drops a counter's _total
    assert done.type == "counter" and done.samples[0].value == metrics["requests_done"] >= 1
    assert families["jaxrl_slots"].type == "gauge"
    assert families["jaxrl_slots"].samples[0].value == metrics["slots"]
    assert families["jaxrl_a_name"].samples[0].value == 1.5
    assert families["jaxrl_flag"].samples[0].value == 1
    assert "jaxrl_nan" not in families and "jaxrl_label" not in families
