"""Issue 19 item 2, done-criterion: a standalone Spark cluster (master + worker from the pyspark package, on
127.0.0.1, executors with only the shipped zip) reads, through the S3 API server, a store whose older segments
exist only in the bucket.

The executors' environment is clean (no AWS variables, no store config): the endpoint and credentials travel
as read options, and the tier's segments reach them only as ranged GETs (the files are gone from disk).
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("pyspark")

from conftest import golden_expected
from test_spark_cluster import shipped  # noqa: F401 - a fixture
from test_spark_tier import MIB, Sink, assert_golden, creds, golden_tier, read, stream  # noqa: F401 - fixtures

from rocketstore.spark import jobs


def test_cluster_reads_a_tier_alone_and_a_store_whose_older_segments_are_only_in_the_bucket(
        spark_cluster, shipped, golden_tier, tmp_path, monkeypatch):  # noqa: F811 - fixtures
    store, uri, conf = golden_tier
    for k, v in spark_cluster.driver_env().items():  # executors run the cluster's Python (the zip only)
        monkeypatch.setenv(k, v)
    exp = sorted(golden_expected("basic"), key=lambda e: e["commitLogOffset"])
    assert not os.path.exists(store / "commitlog" / "00000000000000000000")
    spark = jobs.session(spark_cluster.master_url, spark_cluster.driver_conf(shipped), app_name="rocketstore tier read")
    try:
        spark.sparkContext.setLogLevel("ERROR")
        assert spark.sparkContext.master == spark_cluster.master_url
        alone = read(spark, uri, creds(conf), maxPartitionBytes=1)
        assert alone.rdd.getNumPartitions() == 3
        assert_golden(alone.collect(), [e for e in exp if e["commitLogOffset"] < 3 * MIB])
        assert_golden(read(spark, store, {}, maxPartitionBytes=1).collect(), exp)
        sink = Sink()
        stream(spark, store, {"startingOffsets": "earliest", "maxBytesPerTrigger": MIB}, sink, tmp_path / "chk")
        assert [o for o, _ in sink.rows()] == [e["commitLogOffset"] for e in exp]
        apps = [a["name"] for a in spark_cluster.state()["activeapps"]]
    finally:
        spark.stop()
    assert apps == ["rocketstore tier read"]  # it ran on the cluster, not in local mode
