"""Start a lucekv cluster on loopback: Redis, N replicas (`lucekv serve`) and HAProxy with deploy/haproxy's
configuration, as deploy/k8s runs them in containers. For trying the deployment on one machine and for the
acceptance tests (tests/deploy/), which drive it through `LocalCluster`.

    python deploy/local/cluster.py --replicas 3 --model smollm2-135m --port 50051 -- --backend cpu

Arguments after `--` go to every `lucekv serve`; LUCEKV_* variables reach the replicas too. Ctrl-C or SIGTERM
stops the replicas gracefully (they drain and save their sessions), then HAProxy and Redis.
Needs redis-server and haproxy on PATH (Debian: apt-get install redis-server haproxy).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEPLOY = Path(__file__).resolve().parents[1]
HAPROXY_CONFIG = DEPLOY / "haproxy" / "haproxy.cfg"
SERVING = re.compile(r"lucekv: serving .* on \S+:(\d+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, process: subprocess.Popen, what: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start:\n{log.read_text(errors='replace')[-4000:]}") from None
            time.sleep(0.05)


class LocalCluster:
    """Redis + `replicas` lucekv servers + HAProxy on loopback ports, logs and data under `workdir`."""

    def __init__(self, model: str, replicas: int = 3, serve_args: tuple[str, ...] = (), port: int = 0,
                 workdir: Path | None = None, python: str = sys.executable, env: dict[str, str] | None = None):
        self.model = model
        self.serve_args = tuple(serve_args)
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="lucekv-cluster-"))
        self.python = python
        self.env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
        self.port = port or free_port()
        self.replica_ports = [free_port() for _ in range(replicas)]
        self.metrics_ports = [free_port() for _ in range(replicas)]
        self.redis_port = free_port()
        self.replicas: list[subprocess.Popen | None] = [None] * replicas
        self._redis: subprocess.Popen | None = None
        self._proxy: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        """The proxy: where clients connect."""
        return f"127.0.0.1:{self.port}"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def replica_address(self, i: int) -> str:
        return f"127.0.0.1:{self.replica_ports[i]}"

    def start(self, timeout: float = 120) -> LocalCluster:
        for tool in ("redis-server", "haproxy"):
            if shutil.which(tool) is None:
                raise RuntimeError(f"{tool} is not installed (Debian: apt-get install redis-server haproxy)")
        log = self.workdir / "redis.log"
        self._redis = subprocess.Popen(
            ["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
             "--save", "", "--appendonly", "no", "--logfile", str(log)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.redis_port, self._redis, "redis-server", log, timeout)
        for i in range(len(self.replicas)):
            self._launch(i)
        for i in range(len(self.replicas)):
            self.wait_serving(i, timeout)
        self._start_proxy(timeout)
        return self

    def _launch(self, i: int) -> None:
        command = [self.python, "-m", "lucekv.cli", "serve", "--model", self.model, "--host", "127.0.0.1",
                   "--port", str(self.replica_ports[i]), "--metrics-port", str(self.metrics_ports[i]),
                   "--snapshot-store", self.redis_url, *self.serve_args]
        with open(self.workdir / f"replica-{i}.log", "ab") as log:
            self.replicas[i] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                                cwd=DEPLOY.parent)

    def wait_serving(self, i: int, timeout: float = 120) -> None:
        wait_for_port(self.replica_ports[i], self.replicas[i], f"replica {i}", self.workdir / f"replica-{i}.log",
                      timeout)

    def _start_proxy(self, timeout: float) -> None:
        servers = "".join(f"    server replica-{i} 127.0.0.1:{port}\n" for i, port in enumerate(self.replica_ports))
        replicas_cfg = self.workdir / "replicas.cfg"
        replicas_cfg.write_text(f"backend replicas from lucekv-replicas\n{servers}")
        log = self.workdir / "haproxy.log"
        with open(log, "ab") as out:
            self._proxy = subprocess.Popen(
                ["haproxy", "-db", "-f", str(HAPROXY_CONFIG), "-f", str(replicas_cfg)], stdout=out,
                stderr=subprocess.STDOUT, env={**self.env, "LUCEKV_PROXY_BIND": f"127.0.0.1:{self.port}"})
        wait_for_port(self.port, self._proxy, "haproxy", log, timeout)

    def kill(self, i: int) -> None:
        """SIGKILL: the replica dies at once, saving nothing."""
        self.replicas[i].kill()
        self.replicas[i].wait()

    def terminate(self, i: int, timeout: float = 60) -> int:
        """SIGTERM: the replica drains and saves its sessions; its exit code."""
        self.replicas[i].send_signal(signal.SIGTERM)
        return self.replicas[i].wait(timeout)

    def restart(self, i: int, timeout: float = 120) -> None:
        if self.replicas[i].poll() is None:
            self.terminate(i)
        self._launch(i)
        self.wait_serving(i, timeout)

    def log(self, i: int) -> str:
        return (self.workdir / f"replica-{i}.log").read_text(errors="replace")

    def stop(self) -> None:
        for process in self.replicas:
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.replicas:
            if process is not None:
                try:
                    process.wait(60)
                except subprocess.TimeoutExpired:
                    process.kill()
        for process in (self._proxy, self._redis):
            if process is not None and process.poll() is None:
                process.terminate()
                process.wait(10)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--port", type=int, default=50051, help="the proxy's port (default 50051)")
    parser.add_argument("--workdir", type=Path, help="logs and Redis data (default: a new temp dir)")
    parser.add_argument("serve_args", nargs="*", help="after --: arguments of every `lucekv serve`")
    args = parser.parse_args()
    cluster = LocalCluster(args.model, args.replicas, tuple(args.serve_args), args.port, args.workdir)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        cluster.start()
        print(f"lucekv cluster: proxy on {cluster.address}; replicas on "
              f"{', '.join(cluster.replica_address(i) for i in range(args.replicas))} (metrics on ports "
              f"{', '.join(map(str, cluster.metrics_ports))}); Redis {cluster.redis_url}; logs in {cluster.workdir}",
              flush=True)
        while not stop:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
