"""Nothing `peagle serve` starts listens beyond 127.0.0.1 but what Ray Serve hard-codes: Serve's endpoint and every
port of the Ray it starts (gRPC servers, dashboard, the Prometheus exporters that show our metrics, the node IP and
the session name) are on loopback.

The exception: each Serve replica's inter-deployment gRPC server binds `[::]:0` whatever the node IP
(ray/serve/_private/replica.py, `add_port_to_grpc_server(self._server, "[::]:0")`), behind Ray's token auth.

Runs the real command in a subprocess and reads the listening sockets of its whole process tree.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import psutil
import pytest

pytest.importorskip("ray")

pytestmark = pytest.mark.slow

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
SERVE_REPLICAS = {"ray::ServeReplica:peagle:OpenAIRouter", "ray::ServeReplica:peagle:EngineReplica"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(pids: set[int]) -> list[tuple[str, int, str]]:
    out = []
    for c in psutil.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and c.pid in pids:
            try:
                name = psutil.Process(c.pid).name()
            except psutil.Error:
                name = "?"
            out.append((c.laddr.ip, c.laddr.port, name))
    return sorted(set(out))


def _tree(pid: int) -> set[int]:
    try:
        p = psutil.Process(pid)
        return {pid} | {c.pid for c in p.children(recursive=True)}
    except psutil.Error:
        return set()


def _prometheus(port: int) -> bool:
    try:
        r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=3)
        return r.status_code == 200 and "ray_" in r.text
    except httpx.HTTPError:
        return False


def test_peagle_serve_listens_on_loopback_only():
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen([sys.executable, "-m", "peagle_core.cli", "serve", "tiny", "--port", str(port),
                             "--max-num-seqs", "2"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen: set[int] = set()
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, "peagle serve exited"
            seen |= _tree(proc.pid)
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "peagle serve did not come up"
            time.sleep(1)
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text
        time.sleep(3)  # the agents' exporters start after the node
        seen |= _tree(proc.pid)
        sockets = _listening(seen)
        print(sockets)
        assert ("127.0.0.1", port, "ray::ProxyActor") in sockets
        exposed = [s for s in sockets if s[0] not in LOOPBACK]
        assert {name for _, _, name in exposed} <= SERVE_REPLICAS, exposed
        assert all(ip == "::" for ip, _, _ in exposed), exposed  # the one gRPC server a replica binds everywhere
        # The exporters are up, on loopback: the check above covered them.
        assert any(_prometheus(p) for _, p, name in sockets if "DashboardAgent" in name)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # peagle serve's Ctrl-C path: serve.shutdown(), ray.shutdown()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        time.sleep(2)
        for pid in seen - {os.getpid()}:  # whatever Ray left behind
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
