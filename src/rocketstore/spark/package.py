"""Shipping the code to a cluster: a zip of the ``rocketstore`` package for ``--py-files``, and a launcher.

    python -m rocketstore.spark.package --out dist/
    spark-submit --master yarn --py-files dist/rocketstore.zip dist/rocketstore_spark.py verify /shared/store

(A wheel passed with ``--py-files`` does not work; a zip of the package does.)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import zipfile

LAUNCHER = '''"""spark-submit entry point for rocketstore's Spark jobs (see docs/spark.md)."""
import sys

from rocketstore.spark.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
'''


def package_dir() -> str:
    import rocketstore
    return os.path.dirname(os.path.abspath(rocketstore.__file__))


def build_zip(out: str | None = None) -> str:
    """Zip the installed ``rocketstore`` package (sources only); return the zip's path."""
    src = package_dir()
    if out is None:
        out = os.path.join(tempfile.mkdtemp(prefix="rocketstore-pyfiles-"), "rocketstore.zip")
    tmp = out + ".tmp"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zf:
        for d, dirs, names in os.walk(src):
            dirs[:] = sorted(x for x in dirs if x != "__pycache__")
            for n in sorted(names):
                if n.endswith((".pyc", ".pyo")):
                    continue
                path = os.path.join(d, n)
                zf.write(path, os.path.join("rocketstore", os.path.relpath(path, src)))
    os.replace(tmp, out)
    return out


def write_launcher(path: str) -> str:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(LAUNCHER)
    return path


def build(out_dir: str) -> dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    return {"pyFiles": build_zip(os.path.join(out_dir, "rocketstore.zip")),
            "launcher": write_launcher(os.path.join(out_dir, "rocketstore_spark.py"))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rocketstore.spark.package",
                                description="zip rocketstore for spark-submit --py-files, with a launcher script")
    p.add_argument("--out", default="dist", metavar="DIR")
    args = p.parse_args(argv)
    import json
    sys.stdout.write(json.dumps(build(args.out)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
