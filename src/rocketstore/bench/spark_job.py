"""The Spark scan workload, run in its own process (one JVM, local[2]).

``python -m rocketstore.bench.spark_job STORE WORKDIR REPEATS`` runs
:func:`rocketstore.bench.spark_scan.bench_spark_scan` (a body-less scan through the
``rocketstore`` data source against Spark over the same rows exported to
Parquet, best of REPEATS after a warm-up) and prints ``DONE <json>``.  A
process of its own keeps the JVM out of the suite and lets py-spy follow it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m rocketstore.bench.spark_job",
                                     description="The benchmark's Spark scan workload (run by rocketstore bench).")
    parser.add_argument("store", metavar="STORE", help="store to scan")
    parser.add_argument("workdir", metavar="WORKDIR", help="scratch directory for the Parquet copy")
    parser.add_argument("repeats", metavar="REPEATS", type=int, help="timed scans; the best one counts")
    args = parser.parse_args(argv)
    store, workdir, repeats = args.store, args.workdir, args.repeats
    # Spark's Python workers must run this interpreter (the one that has rocketstore and its dependencies).
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from rocketstore.bench.spark_scan import bench_spark_scan
    sys.stdout.write("DONE " + json.dumps(bench_spark_scan(store, workdir, repeats=repeats)) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
