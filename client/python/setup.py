"""Generates the kvpool.v1 stubs (gen_proto.sh) before setuptools looks for the packages, and
requires grpcio and protobuf at least at the versions the stubs were generated for.

In a checkout the stubs come from ../../proto (or $KVPOOL_PROTO_ROOT) every time (they are git-ignored); an sdist
carries them and has no proto/ beside it.
"""

import os
import pathlib
import re
import subprocess
import sys

from setuptools import setup

here = pathlib.Path(__file__).resolve().parent
proto_root = pathlib.Path(os.environ.get("KVPOOL_PROTO_ROOT", here / "../../proto"))
if (proto_root / "kvpool/v1/kvpool.proto").exists():
    # The caller's environment is kept: pip's isolated build puts grpcio-tools on PYTHONPATH.
    subprocess.run(["bash", str(here / "gen_proto.sh")], check=True,
                   env={**os.environ, "PYTHON": sys.executable})


def generated_versions(stubs: pathlib.Path):
    """(grpcio, protobuf) versions the stubs check at import, or the oldest supported where an
    older generator wrote no check."""
    grpc_stub = (stubs / "kvpool_pb2_grpc.py").read_text()
    pb_stub = (stubs / "kvpool_pb2.py").read_text()
    grpc_version = re.search(r"^GRPC_GENERATED_VERSION = '([0-9.]+)'", grpc_stub, re.M)
    pb_version = re.search(
        r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*"
        r"(\d+),\s*(\d+),\s*(\d+),", pb_stub)
    return (grpc_version.group(1) if grpc_version else "1.51",
            ".".join(pb_version.groups()) if pb_version else "4.21")


grpc_floor, protobuf_floor = generated_versions(here / "kvpool_client/v1")
setup(install_requires=[f"grpcio>={grpc_floor}", f"protobuf>={protobuf_floor}", "numpy>=1.24"])
