"""The Spark scan workload, run in its own process (one JVM, local[2]).

``python -m rocketstore.bench.spark_job STORE WORKDIR REPEATS`` reads the store
through the ``rocketstore`` data source without bodies, exports the same rows
to Parquet with Spark, then scans both the same way (every column
materialised into Spark's ``noop`` sink), best of REPEATS after one warm-up
each, and prints ``DONE <json>``.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _scan_seconds(df, repeats: int) -> float:
    df.write.format("noop").mode("overwrite").save()  # warm-up: Python workers, JIT, page cache
    best = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        df.write.format("noop").mode("overwrite").save()
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    return best or 1e-9


def main(argv: list[str]) -> None:
    store, workdir, repeats = argv[0], argv[1], int(argv[2])
    # Spark's Python workers must run this interpreter (the one that has rocketstore and its dependencies).
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    import rocketstore.spark as rs_spark

    t0 = time.perf_counter()
    spark = (SparkSession.builder.master("local[2]").appName("rocketstore-bench")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "2")
             .config("spark.driver.memory", "1g").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    start_s = time.perf_counter() - t0
    try:
        rs_spark.register(spark)
        df = spark.read.format(rs_spark.FORMAT).option("withBody", "false").load(store)
        rows = df.count()
        rs_s = _scan_seconds(df, repeats)
        pq = os.path.join(workdir, "messages.parquet")
        t0 = time.perf_counter()
        df.write.mode("overwrite").parquet(pq)
        export_s = time.perf_counter() - t0
        pdf = spark.read.parquet(pq)
        prows = pdf.count()
        pq_s = _scan_seconds(pdf, repeats)
        pq_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(pq) for f in fs)
    finally:
        spark.stop()
    out = {"rows": rows, "parquet_rows": prows, "columns": len(df.columns), "repeats": repeats,
           "rocketstore_seconds": rs_s, "parquet_seconds": pq_s, "rocketstore_rows_per_s": rows / rs_s,
           "parquet_rows_per_s": prows / pq_s, "export_seconds": export_s, "parquet_bytes": pq_bytes,
           "spark_start_seconds": start_s}
    sys.stdout.write("DONE " + json.dumps(out) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
