"""deploy/haproxy/haproxy.cfg: valid for HAProxy, and its health check is the gRPC exchange it claims to be."""

from __future__ import annotations

import asyncio
import re
import shutil
import socket
import struct
import subprocess
import threading

import grpc
import pytest
import yaml
from cluster_harness import DEPLOY
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from lucekv.server.config import env_name, settings

CONFIG = DEPLOY / "haproxy" / "haproxy.cfg"


def _config_line(keyword: str) -> str:
    return next(line.split("#")[0].split()[-1] for line in CONFIG.read_text().splitlines()
                if line.strip().startswith(keyword))


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _literal(prefix: bytes, value: str) -> bytes:
    """HPACK literal header field without indexing, its name from `prefix` (a static-table index or a new name)."""
    return prefix + bytes([len(value)]) + value.encode()


def health_check_request(service: str) -> bytes:
    """An HTTP/2 client's whole grpc.health.v1.Health/Check call: preface, empty SETTINGS, HEADERS, DATA."""
    headers = (b"\x83\x86"  # :method POST, :scheme http (static table 3, 6)
               + _literal(b"\x04", "/grpc.health.v1.Health/Check")  # :path (4)
               + _literal(b"\x01", "lucekv")  # :authority (1)
               + _literal(b"\x0f\x10", "application/grpc")  # content-type (31)
               + _literal(b"\x00\x02te", "trailers"))
    message = health_pb2.HealthCheckRequest(service=service).SerializeToString()
    data = b"\x00" + struct.pack(">I", len(message)) + message  # gRPC length-prefixed message
    return (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(0x4, 0, 0, b"") + _frame(0x1, 0x4, 1, headers)
            + _frame(0x0, 0x1, 1, data))


def test_the_health_check_bytes_are_a_health_check_of_the_lucekv_service():
    assert _config_line("tcp-check send-binary") == health_check_request("lucekv.v1.LuceKV").hex()
    serving = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING).SerializeToString()
    assert _config_line("tcp-check expect binary") == (b"\x00" + struct.pack(">I", len(serving)) + serving).hex()


@pytest.fixture
def health_server():
    """A gRPC server with only grpc.health.v1 on its own loop; yields (port, set_status)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    servicer = health.aio.HealthServicer()

    async def start():
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)

    def set_status(status):
        asyncio.run_coroutine_threadsafe(servicer.set("lucekv.v1.LuceKV", status), loop).result(10)

    yield port, set_status
    asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def _exchange(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(bytes.fromhex(_config_line("tcp-check send-binary")))
        received = b""
        s.settimeout(1.0)
        try:
            while chunk := s.recv(4096):
                received += chunk
                if b"grpc-status" in received:
                    break
        except TimeoutError:
            pass
    return received


def test_the_check_passes_on_serving_and_fails_on_not_serving(health_server):
    port, set_status = health_server
    expected = bytes.fromhex(_config_line("tcp-check expect binary"))
    set_status(health_pb2.HealthCheckResponse.SERVING)
    assert expected in _exchange(port)
    set_status(health_pb2.HealthCheckResponse.NOT_SERVING)  # a draining replica
    answer = _exchange(port)
    assert expected not in answer and re.search(rb"grpc-status", answer)


@pytest.mark.parametrize("replicas", ["local", "compose/replicas.cfg", "k8s/replicas.cfg"])
def test_haproxy_accepts_the_config_with_each_deployments_replicas(tmp_path, replicas):
    haproxy = shutil.which("haproxy")
    if haproxy is None:
        pytest.skip("haproxy is not installed")
    if replicas == "local":  # as deploy/local/cluster.py writes it
        path = tmp_path / "replicas.cfg"
        path.write_text("backend replicas from lucekv-replicas\n    server replica-1 127.0.0.1:50051\n")
    else:
        path = DEPLOY / replicas
    checked = subprocess.run([haproxy, "-c", "-f", str(CONFIG), "-f", str(path)], capture_output=True, text=True,
                             env={"LUCEKV_PROXY_BIND": "127.0.0.1:50051"})  # checked, not bound
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # only DNS names that resolve inside Docker or Kubernetes, not here, may be warned about
    warnings = [line for line in (checked.stdout + checked.stderr).splitlines() if "WARNING" in line]
    assert all("could not resolve address" in line for line in warnings), warnings


def test_the_kubernetes_manifests_hold_what_a_replicated_deployment_needs():
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    docs = [d for f in kustomization["resources"] for d in yaml.safe_load_all((DEPLOY / f).read_text())]
    for generated in kustomization["configMapGenerator"]:
        assert all((DEPLOY / f).is_file() for f in generated["files"])
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    replicas = by_kind[("Deployment", "lucekv")]["spec"]["template"]["spec"]
    container = replicas["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["readinessProbe"]["grpc"]["service"] == "lucekv.v1.LuceKV"
    assert container["livenessProbe"]["grpc"]["service"] == ""
    drain = float(by_kind[("ConfigMap", "lucekv-settings")]["data"]["LUCEKV_DRAIN_SECONDS"])
    assert replicas["terminationGracePeriodSeconds"] > drain
    assert by_kind[("Service", "lucekv-replicas")]["spec"]["clusterIP"] == "None"
    assert ("PodDisruptionBudget", "lucekv") in by_kind
    variables = by_kind[("ConfigMap", "lucekv-settings")]["data"]
    assert set(variables) <= {env_name(f.name) for f in settings()}  # every variable is one lucekv reads


def test_the_compose_file_runs_three_gpu_replicas_on_one_redis_behind_the_proxy():
    compose = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())["services"]
    replicas = [s for name, s in compose.items() if name.startswith("replica-")]
    assert len(replicas) == 3
    for replica in replicas:
        assert replica["environment"]["LUCEKV_SNAPSHOT_STORE"] == "redis://redis:6379/0"
        assert replica["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert {f"{name} " for name in compose if name.startswith("replica-")} == {
        line.split()[1] + " " for line in (DEPLOY / "compose" / "replicas.cfg").read_text().splitlines()
        if line.strip().startswith("server ")}
