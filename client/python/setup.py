"""Build step: generates the kvpool.v1 stubs (gen_proto.sh) before packaging."""

import pathlib
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithStubs(build_py):
    def run(self):
        here = pathlib.Path(__file__).resolve().parent
        subprocess.run(["bash", str(here / "gen_proto.sh")], check=True,
                       env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
        super().run()


setup(cmdclass={"build_py": BuildWithStubs})
