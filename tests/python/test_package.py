"""client/python builds into a wheel from a clean checkout (no generated stubs yet), and the
wheel's package imports with its stubs and requires the grpcio and protobuf they were generated
for."""

import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_wheel_from_a_clean_checkout_carries_the_stubs(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT / "proto", src / "proto")
    shutil.copytree(ROOT / "client/python", src / "client/python",
                    ignore=shutil.ignore_patterns("v1", "__pycache__", ".pytest_cache",
                                                  "*.egg-info", "build"))
    assert not (src / "client/python/kvpool_client/v1").exists()
    out = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                    "-q", "-w", str(out), str(src / "client/python")], check=True)
    (wheel,) = out.glob("kvpool_client-*.whl")
    archive = zipfile.ZipFile(wheel)
    names = archive.namelist()
    for stub in ("kvpool_pb2.py", "kvpool_pb2_grpc.py", "__init__.py"):
        assert f"kvpool_client/v1/{stub}" in names
    # It requires the runtime versions its stubs check at import.
    (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    requires = [line.split(":", 1)[1].strip() for line in
                archive.read(metadata).decode().splitlines() if line.startswith("Requires-Dist:")]
    grpc_stub = archive.read("kvpool_client/v1/kvpool_pb2_grpc.py").decode()
    generated = re.search(r"^GRPC_GENERATED_VERSION = '([0-9.]+)'", grpc_stub, re.M).group(1)
    assert f"grpcio>={generated}" in requires
    pb_stub = archive.read("kvpool_client/v1/kvpool_pb2.py").decode()
    protoc = re.search(r"^# Protobuf Python Version: ([0-9.]+)", pb_stub, re.M).group(1)
    assert f"protobuf>={protoc}" in requires
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(target), str(wheel)], check=True)
    probe = ("import kvpool_client, kvpool_client.v1.kvpool_pb2 as pb; "
             "print(kvpool_client.__file__); print(pb.AttendRequest.DESCRIPTOR.full_name)")
    lines = subprocess.run([sys.executable, "-c", probe], check=True, cwd=tmp_path,
                           env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
                           capture_output=True, text=True).stdout.split()
    assert lines[0].startswith(str(target))
    assert lines[1] == "kvpool.v1.AttendRequest"
