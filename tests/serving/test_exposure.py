"""Who can reach the server: loopback unless asked otherwise, TLS when given a certificate, and a
bound on RPCs in progress beyond which clients get RESOURCE_EXHAUSTED at once."""

import datetime
import ipaddress
import threading

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from jaxrl.commands.serve import read_tls
from jaxrl.errors import UserError
from serving.core.orchestrator import Orchestrator
from serving.frontends.server import Server, is_loopback
from serving.proto import generation_pb2 as gen
from serving.proto import generation_pb2_grpc as gen_grpc
from tests.serving.common import prompts


def self_signed(tmp_path):
    """A certificate for 127.0.0.1 and localhost, and its key, as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def _generate(channel, max_tokens=3):
    request = gen.GenerateRequest(token_ids=gen.TokenIds(ids=prompts(4, seed=3)[0]),
                                  sampling=gen.SamplingOptions(max_tokens=max_tokens,
                                                               temperature=0.0, ignore_eos=True))
    return gen_grpc.GenerationStub(channel).Generate(request, timeout=60)


def test_loopback_addresses():
    assert all(map(is_loopback, ["127.0.0.1", "127.3.4.5", "localhost", "::1", "[::1]"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.0.0.7", "example.org"]))


def test_a_reachable_host_needs_allow_remote(engine, params):
    orchestrator = Orchestrator(engine, params)
    for host in ("0.0.0.0", "::"):
        with pytest.raises(ValueError, match=f"host '{host}' is reachable from other machines; "
                                             f"pass allow_remote"):
            Server(orchestrator, host=host, port=0)


def test_tls_serves_encrypted_and_refuses_plaintext(engine, tmp_path, params):
    cert_path, key_path = self_signed(tmp_path)
    tls = read_tls(str(cert_path), str(key_path))
    server = Server(Orchestrator(engine, params).start(), port=0, tls=tls).start()
    try:
        creds = grpc.ssl_channel_credentials(root_certificates=cert_path.read_bytes())
        with grpc.secure_channel(f"localhost:{server.port}", creds) as channel:
            out = list(_generate(channel))
            assert sum(len(r.token_ids) for r in out) == 3
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            with pytest.raises(grpc.RpcError) as err:
                list(_generate(channel))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()


@pytest.mark.parametrize("cert, key, message", [
    ("cert.pem", None, "--tls-cert and --tls-key go together"),
    ("missing.pem", "key.pem", "--tls-cert '.*missing.pem': no such file or directory"),
    ("plain.txt", "key.pem", "--tls-cert '.*plain.txt' is not a PEM file"),
])
def test_bad_tls_flags_are_one_line(tmp_path, cert, key, message):
    self_signed(tmp_path)
    (tmp_path / "plain.txt").write_text("hello")
    with pytest.raises(UserError, match=message):
        read_tls(str(tmp_path / cert), key and str(tmp_path / key))


def test_rpcs_past_the_bound_get_resource_exhausted(engine, params):
    server = Server(Orchestrator(engine, params).start(), port=0, max_concurrent_rpcs=2).start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            # Two streams held open (not read past their first token) fill the bound.
            held = [_generate(channel, max_tokens=40) for _ in range(2)]
            for stream in held:
                next(stream)
            with pytest.raises(grpc.RpcError) as err:
                list(_generate(channel))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            for stream in held:
                stream.cancel()
            done = threading.Event()
            for _ in range(600):   # the cancelled RPCs end; the bound frees up (30 s at most)
                try:
                    list(_generate(channel))
                    done.set()
                    break
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    threading.Event().wait(0.05)
            assert done.is_set()
    finally:
        server.stop()
