"""``rocketstore spark ...``: the distributed jobs from the command line.

    rocketstore spark verify STORE [--json]
    rocketstore spark rebuild STORE
    rocketstore spark export STORE --to DIR [--format parquet] [--partition-by topic,date]
                             [--topic T] [--from-time MS] [--to-time MS] [--max-messages N] [--max-bytes N]
    rocketstore spark import STORE --from DIR [--replay]
    rocketstore spark stats STORE [--json] [--plot traffic.png]
    rocketstore spark package [--out DIR]

Every job takes ``--master`` (default ``local[*]``, or spark-submit's) and
``--conf key=value``.  Under spark-submit the same arguments follow the
launcher script (:mod:`rocketstore.spark.package`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from ..errors import CliError, StoreError
from ..paths import StorePaths

log = logging.getLogger(__name__)


def _conf(items: list[str]) -> dict[str, str]:
    out = {}
    for kv in items:
        k, sep, v = kv.partition("=")
        if not sep or not k.strip():
            raise CliError(f"--conf {kv!r}: expected key=value")
        out[k.strip()] = v
    return out


def _emit(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, ensure_ascii=False, default=str) + "\n")


# The closing line of a Python traceback: "ValueError: bad value" (Java's "org.x.FooException: ..." excluded).
_PY_ERROR = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)): (.*)$")
_NOT_PYTHON = ("org.", "java.", "javax.", "scala.", "py4j.", "io.netty.")
_STORE_ERRORS = {"StoreError"} | {c.__name__ for c in StoreError.__subclasses__()}


def _texts(e: BaseException | None, depth: int = 0) -> list[str]:
    """Every text Spark keeps of a failure: the message, the captured description, stack and cause."""
    if e is None or depth > 4:
        return []
    out = [str(e)]
    for attr in ("desc", "stackTrace"):
        v = getattr(e, attr, None)
        if isinstance(v, str) and v:
            out.append(v)
    java = getattr(e, "java_exception", None)
    if java is not None:
        out.append(str(java))
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException) and cause is not e:
        out += _texts(cause, depth + 1)
    return out


def _spark_error(e: BaseException) -> StoreError:
    """One line for a failure that happened inside Spark.

    A Python worker's error is buried in Spark's text ("An exception was thrown from the Python
    worker:" and a traceback): show the worker's own exception, its message only for the store's
    errors, "Type: message" for any other.
    """
    found: tuple[str, str] | None = None
    for text in _texts(e):
        for ln in text.splitlines():
            m = _PY_ERROR.match(ln.strip())
            if m and not m.group(1).startswith(_NOT_PYTHON):
                found = (m.group(1), m.group(2).strip())
        if found:
            break
    if found is None:
        text = str(e)
        line = next((ln.strip() for ln in text.splitlines() if ln.strip()), repr(e))
        return StoreError(line[:2000])
    name, message = found
    if name.startswith("rocketstore.") or name.rsplit(".", 1)[-1] in _STORE_ERRORS:
        return StoreError(message[:2000])
    return StoreError(f"{name.rsplit('.', 1)[-1]}: {message}"[:2000])


# Jobs that read an existing store: a local STORE that is missing or a file is refused before the JVM starts
# (seconds, and its warnings on stderr), as the other commands refuse it.
_READS_A_STORE = ("verify", "rebuild", "export", "stats")


def _refuse_missing_store(args: argparse.Namespace) -> None:
    store = args.store
    if args.spark_command not in _READS_A_STORE or "://" in store:
        return
    if not os.path.isdir(store):
        raise StoreError(f"{store}: " + ("not a directory (a store is a directory)" if os.path.exists(store)
                                         else "no such store directory"))
    if not os.path.isdir(StorePaths(store).commitlog):  # (what the source's planner refuses, in the JVM's time)
        raise StoreError(f"{store}: not a message store (no commitlog directory)")


def _run(args: argparse.Namespace, job: Callable[[Any, argparse.Namespace], int]) -> int:
    from . import jobs
    _refuse_missing_store(args)
    conf = _conf(args.conf or [])
    try:
        spark = jobs.session(args.master, conf, app_name=f"rocketstore {args.spark_command}")
    except StoreError:
        raise
    except Exception as e:  # noqa: BLE001 - no JVM, bad master...
        raise StoreError(f"cannot start Spark: {_spark_error(e)}") from None
    try:
        return job(spark, args)
    except StoreError:
        raise
    except Exception as e:
        from py4j.protocol import Py4JJavaError
        from pyspark.errors import PySparkException
        if isinstance(e, (PySparkException, Py4JJavaError)):
            raise _spark_error(e) from None
        raise
    finally:
        if not args.keep_session:
            spark.stop()


def _verify(spark: Any, args: argparse.Namespace) -> int:
    from . import jobs
    result = jobs.verify(spark, args.store, args.config)
    if args.json:
        _emit(result)
    else:
        from ..cli.store import print_verify_table  # the table `rocketstore verify` prints
        print_verify_table(result)
    return 0 if result["ok"] else 1


def _rebuild(spark: Any, args: argparse.Namespace) -> int:
    from . import jobs
    _emit(jobs.rebuild(spark, args.store, args.config))
    return 0


def _export(spark: Any, args: argparse.Namespace) -> int:
    from . import jobs
    from ..cli.store import selection_from_args
    opts = {} if not args.no_body else {"withBody": "false"}
    _emit(jobs.export(spark, args.store, args.to, fmt=args.format, partition_by=(args.partition_by or "").split(","),
                      mode=args.mode, options=opts, selection=selection_from_args(args)))
    return 0


def _import(spark: Any, args: argparse.Namespace) -> int:
    from . import jobs
    opts = {"config": args.config} if args.config else {}
    _emit(jobs.import_files(spark, args.source, args.store, fmt=args.format, replay=args.replay, options=opts))
    return 0


def _stats(spark: Any, args: argparse.Namespace) -> int:
    from . import jobs
    result = jobs.stats(spark, args.store, plot=args.plot)
    if args.json:
        _emit(result)
    else:
        sys.stdout.write(jobs.stats_table(result))
    return 0


def _package(args: argparse.Namespace) -> int:
    from .package import build
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise StoreError(f"{args.out}: not a directory (--out names the directory to write the zip and launcher to)")
    _emit(build(args.out))
    return 0


def add_jobs(ssub: argparse._SubParsersAction) -> None:
    def add(name: str, job: Callable[[Any, argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        p = ssub.add_parser(name, help=help, description=help)
        p.add_argument("store", metavar="STORE", help="store root directory (every executor must see it)")
        p.add_argument("--master", default=None, help="Spark master (default local[*], or spark-submit's)")
        p.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE", help="Spark configuration")
        p.add_argument("--keep-session", action="store_true", help=argparse.SUPPRESS)
        p.set_defaults(handler=lambda args, job=job: _run(args, job), spark_command=name)
        return p

    p = add("verify", _verify, "parallel CRC check of every record, cross-check of consume queues and index "
            "(exit 1 if not OK)")
    p.add_argument("--config", metavar="FILE", help="broker.conf style file (geometry)")
    p.add_argument("--json", action="store_true", help="JSON instead of a table")

    p = add("rebuild", _rebuild, "rebuild consume queues and index from the commitlog (store must not be open)")
    p.add_argument("--config", metavar="FILE", help="broker.conf style file (geometry, when the files are gone)")

    from ..cli.store import add_selection_flags
    p = add("export", _export, "messages as Parquet (or ORC) files: all, or those the dump flags select")
    p.add_argument("--to", required=True, metavar="DIR", help="output directory")
    p.add_argument("--format", default="parquet", choices=["parquet", "orc"], help="file format (default parquet)")
    p.add_argument("--partition-by", metavar="COLS", help="comma-separated: topic, queueId, date, hour (UTC)")
    p.add_argument("--mode", default="errorifexists", choices=["errorifexists", "overwrite", "append", "ignore"],
                   help="Spark save mode when DIR exists (default errorifexists)")
    p.add_argument("--no-body", action="store_true", help="leave bodies out")
    add_selection_flags(p)

    p = add("import", _import, "append the messages of an export (Parquet/ORC with topic and body) to a store")
    p.add_argument("--from", dest="source", required=True, metavar="DIR", help="directory written by spark export")
    p.add_argument("--format", default="parquet", choices=["parquet", "orc"], help="file format (default parquet)")
    p.add_argument("--replay", action="store_true",
                   help="keep store times, hosts and exact properties, in commitLogOffset order")
    p.add_argument("--config", metavar="FILE", help="broker.conf for a new store's geometry")

    p = add("stats", _stats, "messages and bytes per topic, queue and hour, body sizes, keys, dispatch lag")
    p.add_argument("--json", action="store_true", help="JSON instead of a table")
    p.add_argument("--plot", metavar="FILE.png", help="also draw traffic over time")

    p = ssub.add_parser("package", help="zip rocketstore for spark-submit --py-files, with a launcher script")
    p.add_argument("--out", default="dist", metavar="DIR", help="where the zip and launcher go (default dist)")
    p.set_defaults(handler=_package, spark_command="package")


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``rocketstore spark ...`` to the main command."""
    p = sub.add_parser("spark", help="distributed jobs on Spark: verify, rebuild, export, import, stats",
                       description="distributed jobs on Spark (pyspark needed)")
    ssub = p.add_subparsers(dest="spark_command", metavar="JOB", parser_class=type(p))
    ssub.required = True
    add_jobs(ssub)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"rocketstore spark: error: {message}\n")
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    """The jobs without the ``rocketstore`` command around them (spark-submit's launcher calls this)."""
    parser = _Parser(prog="rocketstore spark", description="distributed jobs on Spark")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging on stderr")
    ssub = parser.add_subparsers(dest="spark_command", metavar="JOB", parser_class=_Parser)
    ssub.required = True
    add_jobs(ssub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING - 10 * min(args.verbose, 2), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.handler(args) or 0
    except (StoreError, OSError) as e:
        sys.stderr.write(f"rocketstore: error: {e}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
