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
    prunes with its read options instead.  ``ship_code=True`` zips the
    ``rocketstore`` package and adds it to the session's Python files, for
    clusters whose executors do not have it installed (spark-submit
    ``--py-files`` does the same).
    """
    from .source import RocketStoreDataSource
    if ship_code:
        from .package import build_zip
        spark.sparkContext.addPyFile(build_zip())
    spark.dataSource.register(RocketStoreDataSource)


__all__ = ["FORMAT", "register"]
