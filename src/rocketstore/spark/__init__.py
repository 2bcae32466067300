"""PySpark integration: the ``rocketstore`` data source and the distributed jobs.

    import rocketstore.spark
    rocketstore.spark.register(spark)
    df = spark.read.format("rocketstore").load("/data/store")

Everything Spark-related lives in this package; the store core never imports it.
"""

from __future__ import annotations

from typing import Any

FORMAT = "rocketstore"


def register(spark: Any, *, ship_code: bool = False) -> None:
    """Register the ``rocketstore`` format with a SparkSession.

    The session's filter-pushdown setting is left alone: the source pushes no
    filters (see :class:`~rocketstore.spark.source.RocketStoreReader`) and
    prunes with its read options instead.  The option ``minPartitions``
    defaults to the session's default parallelism (a cluster's cores, not
    the driver's).  ``ship_code=True`` zips the
    ``rocketstore`` package and adds it to the session's Python files, for
    clusters whose executors do not have it installed (spark-submit
    ``--py-files`` does the same).
    """
    from .source import RocketStoreDataSource
    try:
        parallelism = int(spark.sparkContext.defaultParallelism)
    except Exception:  # noqa: BLE001 - Spark Connect has no SparkContext: keep the cores fallback
        parallelism = None
    # A subclass made here is pickled by value, so its default travels to the planning worker.
    source = type(RocketStoreDataSource.__name__, (RocketStoreDataSource,),
                  {"default_min_partitions": parallelism, "__doc__": RocketStoreDataSource.__doc__})
    if ship_code:
        from .package import build_zip
        spark.sparkContext.addPyFile(build_zip())
    spark.dataSource.register(source)


__all__ = ["FORMAT", "register"]
