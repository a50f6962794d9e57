"""Bearer tokens, tenants' session namespaces, per-principal limits, TLS and mTLS, on in-process servers."""

from __future__ import annotations

import datetime
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_harness import ServerThread

from lucekv.client import Client, SamplingOptions, TlsOptions
from lucekv.server.auth import Authenticator
from lucekv.server.gen import lucekv_pb2 as pb
from lucekv.server.gen import lucekv_pb2_grpc

ALICE, BOB = "alice-token-0123456789", "bob-token-0123456789ab"
GREEDY = SamplingOptions(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("auth") / "tokens"
    path.write_text(f"# principal token\nalice {ALICE}\nbob {BOB}\n")
    return path


@pytest.fixture(scope="module")
def secured(probe, tokens_file):
    running = ServerThread(probe, auth_tokens=tokens_file, max_prompt_tokens=40, max_blob_bytes=200_000,
                           max_streams=1)
    yield running
    running.stop()


def _every_rpc(stub: lucekv_pb2_grpc.LuceKVStub, metadata) -> dict:
    """Each LuceKV method called once; the status code it ended with."""
    calls = {
        "Generate": lambda: list(stub.Generate(pb.GenerateRequest(text="hi"), metadata=metadata, timeout=10)),
        "Tokenize": lambda: stub.Tokenize(pb.TokenizeRequest(text="hi"), metadata=metadata, timeout=10),
        "Detokenize": lambda: stub.Detokenize(pb.DetokenizeRequest(token_ids=[1]), metadata=metadata, timeout=10),
        "GetServerInfo": lambda: stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=metadata, timeout=10),
        "GetSession": lambda: stub.GetSession(pb.GetSessionRequest(session_id="s"), metadata=metadata, timeout=10),
        "ListSessions": lambda: stub.ListSessions(pb.ListSessionsRequest(), metadata=metadata, timeout=10),
        "DeleteSession": lambda: stub.DeleteSession(pb.DeleteSessionRequest(session_id="s"), metadata=metadata,
                                                    timeout=10),
        "Snapshot": lambda: list(stub.Snapshot(pb.SnapshotRequest(session_id="s"), metadata=metadata, timeout=10)),
        "Restore": lambda: stub.Restore(iter([pb.RestoreChunk(session_id="s", data=b"x")]), metadata=metadata,
                                        timeout=10),
    }
    assert set(calls) == set(pb.DESCRIPTOR.services_by_name["LuceKV"].methods_by_name)
    codes = {}
    for name, call in calls.items():
        try:
            call()
            codes[name] = grpc.StatusCode.OK
        except grpc.RpcError as e:
            codes[name] = e.code()
    return codes


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong-token-0123456789"),),
                                      (("authorization", ALICE),)], ids=["none", "wrong", "not-bearer"])
def test_every_rpc_without_a_valid_token_is_unauthenticated_but_health_is_not(secured, probe, metadata):
    calls = probe.calls
    with grpc.insecure_channel(secured.address) as channel:
        codes = _every_rpc(lucekv_pb2_grpc.LuceKVStub(channel), metadata)
        assert set(codes.values()) == {grpc.StatusCode.UNAUTHENTICATED}
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert probe.calls == calls  # nothing reached the engine


def test_a_valid_token_passes(secured):
    with grpc.insecure_channel(secured.address) as channel:
        codes = _every_rpc(lucekv_pb2_grpc.LuceKVStub(channel), (("authorization", f"Bearer {ALICE}"),))
    assert grpc.StatusCode.UNAUTHENTICATED not in codes.values()
    assert codes["Tokenize"] == codes["Generate"] == grpc.StatusCode.OK


def test_tenants_cannot_see_or_touch_each_others_sessions(secured, reference_engine):
    with Client(secured.address, token=ALICE) as alice, Client(secured.address, token=BOB) as bob:
        first = alice.complete("Once upon", GREEDY, session_id="chat")
        blob = b"".join(alice.snapshot("chat"))
        held = alice.get_session("chat").n_tokens
        assert [s.session_id for s in alice.list_sessions()] == ["chat"]
        assert bob.list_sessions() == []
        for call in (lambda: bob.get_session("chat"), lambda: list(bob.snapshot("chat")),
                     lambda: bob.delete_session("chat")):
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        # bob restoring alice's blob, even under her id, makes a session of bob's; hers is unchanged
        assert bob.restore([blob]).session.session_id == "chat"
        bob.complete("Something else entirely", GREEDY, session_id="chat")
        assert alice.get_session("chat").n_tokens == held
        again = alice.complete(list(first_prompt_ids(reference_engine)) + first.token_ids, GREEDY,
                               session_id="chat")
        assert again.usage.cached_tokens == len(first_prompt_ids(reference_engine)) + len(first.token_ids) - 1
        assert [s.session_id for s in bob.list_sessions()] == ["chat"]
        alice.delete_session("chat")
        bob.delete_session("chat")


def first_prompt_ids(engine) -> list[int]:
    return engine.tokenizer.encode("Once upon")


def test_limits_per_principal(secured, slow_probe):
    with Client(secured.address, token=ALICE) as alice:
        with pytest.raises(grpc.RpcError) as refused:
            alice.complete("word " * 60, GREEDY)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "more than the server's limit of 40" in refused.value.details()
        with pytest.raises(grpc.RpcError) as refused:
            alice.restore([b"\0" * 150_000, b"\0" * 150_000])
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-blob-bytes" in refused.value.details()


def test_concurrent_streams_per_principal(slow_probe, tokens_file):
    running = ServerThread(slow_probe, auth_tokens=tokens_file, max_streams=1)
    try:
        with Client(running.address, token=ALICE) as alice, Client(running.address, token=BOB) as bob:
            long = alice.generate("Hello", SamplingOptions(max_tokens=200, ignore_eos=True))
            next(iter(long))
            with pytest.raises(grpc.RpcError) as refused:
                alice.complete("Hello", GREEDY)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-streams" in refused.value.details()
            bob_stream = bob.generate("Hello", GREEDY)  # another principal has its own count (queued behind)
            long.cancel()
            assert sum(len(c.token_ids) for c in bob_stream) == 4
            assert alice.complete("Hello", GREEDY).usage.completion_tokens == 4  # the slot came back
    finally:
        running.stop()


def test_token_file_errors_name_the_line(tmp_path):
    bad = tmp_path / "tokens"
    bad.write_text("alice short\n")
    with pytest.raises(Exception, match="line 1"):
        Authenticator.from_file(bad)
    bad.write_text(f"al:ice {ALICE}\n")
    with pytest.raises(Exception, match="line 1"):
        Authenticator.from_file(bad)


# --- TLS ---------------------------------------------------------------------------------------------------


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _certificate(subject: str, key, issuer_name: str, issuer_key, ca: bool = False, dns: str | None = None):
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name)]))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if dns:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(dns)]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path | bytes]:
    """A CA, a server certificate for 'localhost' and a client certificate, all signed by it; and a stranger's
    client certificate signed by another CA."""
    d = tmp_path_factory.mktemp("pki")
    ca_key, other_ca_key, server_key, client_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(4))
    files = {
        "ca.pem": _certificate("lucekv test CA", ca_key, "lucekv test CA", ca_key, ca=True),
        "server.pem": _certificate("localhost", server_key, "lucekv test CA", ca_key, dns="localhost"),
        "server.key": _pem_key(server_key),
        "client.pem": _certificate("client", client_key, "lucekv test CA", ca_key),
        "client.key": _pem_key(client_key),
        "stranger.pem": _certificate("stranger", client_key, "other CA", other_ca_key),
    }
    for name, data in files.items():
        (d / name).write_bytes(data)
    return {name: d / name for name in files} | {name + "!": data for name, data in files.items()}


def _tls_client(server: ServerThread, **pem) -> Client:
    return Client(server.address.replace("127.0.0.1", "localhost"), tls=TlsOptions(**pem))


def test_tls_serves_encrypted_and_a_plaintext_client_fails_cleanly(probe, pki):
    running = ServerThread(probe, tls_cert=pki["server.pem"], tls_key=pki["server.key"])
    try:
        with _tls_client(running, ca=pki["ca.pem!"]) as c:
            assert c.tokenize("hi", add_special_tokens=False) == probe.tokenizer.encode("hi", False)
        with Client(running.address) as plain, pytest.raises(grpc.RpcError) as refused:
            plain.tokenize("hi", timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        running.stop()


def test_mtls_needs_a_client_certificate_from_the_ca(probe, pki):
    running = ServerThread(probe, tls_cert=pki["server.pem"], tls_key=pki["server.key"],
                           tls_client_ca=pki["ca.pem"])
    try:
        with _tls_client(running, ca=pki["ca.pem!"], cert=pki["client.pem!"], key=pki["client.key!"]) as c:
            assert c.server_info(timeout=10).model_name
        for pem in ({}, {"cert": pki["stranger.pem!"], "key": pki["client.key!"]}):
            with _tls_client(running, ca=pki["ca.pem!"], **pem) as c, pytest.raises(grpc.RpcError) as refused:
                c.server_info(timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        running.stop()
