"""Fixtures: the generated stubs, and a real kvpool-server on free ports.

The server runs the backend KVPOOL_TEST_BACKEND names (default cpu; the GPU machine's suite runs
these tests with cuda).
"""

import os
import pathlib
import signal
import socket
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
PY_CLIENT = REPO / "client" / "python"

if not (PY_CLIENT / "kvpool_client" / "v1" / "kvpool_pb2.py").exists():
    subprocess.run(["bash", str(PY_CLIENT / "gen_proto.sh")], check=True,
                   env={**os.environ, "PYTHON": sys.executable})
sys.path.insert(0, str(PY_CLIENT))

import grpc  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def attend_socket_port() -> int:
    """The server's AttendSocket port."""
    return _free_port()


@pytest.fixture(scope="session")
def attend_unix_socket(tmp_path_factory) -> str:
    """The server's AttendSocket Unix socket path."""
    return str(tmp_path_factory.mktemp("kvpool") / "attend.sock")


@pytest.fixture(scope="session")
def backend() -> str:
    """The server's --backend."""
    return os.environ.get("KVPOOL_TEST_BACKEND", "cpu")


@pytest.fixture(scope="session")
def server(attend_socket_port, attend_unix_socket, backend):
    """Address of a kvpool-server (KVPOOL_SERVER_BIN, default build/kvpool-server)."""
    binary = os.environ.get("KVPOOL_SERVER_BIN", str(REPO / "build" / "kvpool-server"))
    if not os.access(binary, os.X_OK):
        pytest.fail(f"kvpool-server not found at {binary}; build it or set KVPOOL_SERVER_BIN")
    port = _free_port()
    proc = subprocess.Popen([binary, f"--port={port}", f"--metrics_port={_free_port()}",
                             f"--attend_socket_port={attend_socket_port}",
                             f"--attend_unix_socket={attend_unix_socket}", f"--backend={backend}",
                             f"--pool_bytes={256 << 20}"])
    target = f"127.0.0.1:{port}"
    try:
        with grpc.insecure_channel(target) as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
        yield target
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, "kvpool-server did not exit cleanly on SIGTERM"
