"""Generates the kvpool.v1 stubs (gen_proto.sh) before setuptools looks for the packages.

In a checkout the stubs come from ../../proto (or $KVPOOL_PROTO_ROOT) every time (they are git-ignored); an sdist
carries them and has no proto/ beside it.
"""

import os
import pathlib
import subprocess
import sys

from setuptools import setup

here = pathlib.Path(__file__).resolve().parent
proto_root = pathlib.Path(os.environ.get("KVPOOL_PROTO_ROOT", here / "../../proto"))
if (proto_root / "kvpool/v1/kvpool.proto").exists():
    # The caller's environment is kept: pip's isolated build puts grpcio-tools on PYTHONPATH.
    subprocess.run(["bash", str(here / "gen_proto.sh")], check=True,
                   env={**os.environ, "PYTHON": sys.executable})

setup()
