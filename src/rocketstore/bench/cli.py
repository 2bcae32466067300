"""``rocketstore bench``: the benchmark suite from the command line."""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile

log = logging.getLogger("rocketstore.bench")


def register(subparsers) -> None:
    from .suite import WORKLOAD_NAMES
    p = subparsers.add_parser(
        "bench", help="benchmark rocketstore against SQLite, queue libraries, Redis and the machine's limits",
        description="Runs every workload (a few minutes on 2 cores), measures the peers and limits in the same "
                    "run, and writes <date>-<host>.json, .md and PNG plots. Targets are ratios; no time is "
                    "asserted. Exit status 1 only when a workload itself broke.")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="shorter measurements, 256 MiB recovery, 1 GiB memory run")
    g.add_argument("--smoke", action="store_true",
                   help="a few milliseconds per figure, about 10 s in all: keeps the harness alive in CI")
    p.add_argument("--out", metavar="DIR", help="where the reports go (default: bench/results of the checkout; "
                   "for --smoke a new temporary directory, so a smoke run never replaces the day's full results)")
    p.add_argument("--only", metavar="WORKLOAD", nargs="+", choices=WORKLOAD_NAMES,
                   help=f"run only these workloads (with the peers and limits their ratios need): "
                        f"{', '.join(WORKLOAD_NAMES)}")
    p.add_argument("--workdir", metavar="DIR", help="scratch directory for stores and peers (default: a temporary "
                   "directory; it should be on the disk being measured, not tmpfs)")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    p.add_argument("--seconds", type=float, metavar="S", help="length of each throughput measurement")
    p.add_argument("--profile", action="store_true",
                   help="profile the workloads of missed targets (py-spy, else pyinstrument) into the results")
    p.add_argument("--no-docs", action="store_true",
                   help="do not refresh the table in docs/bench.md and README.md (a full default run does)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from .suite import run_suite
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    out_dir = args.out
    if out_dir is None and args.smoke:
        out_dir = tempfile.mkdtemp(prefix="rocketstore-bench-smoke-")
    summary = run_suite(mode, out_dir=out_dir, only=args.only, workdir=args.workdir, keep=args.keep,
                        profile=args.profile, update_docs=False if args.no_docs else None, seconds=args.seconds,
                        progress=False if args.no_progress else None)
    out = sys.stdout
    out.write(summary["table"] + "\n\n")
    for kind in ("json", "markdown"):
        out.write(f"{kind}: {summary['paths'][kind]}\n")
    for p in summary["paths"]["plots"]:
        out.write(f"plot: {p}\n")
    for d in summary["docs_updated"]:
        out.write(f"updated: {d}\n")
    if summary["failures"]:
        for f in summary["failures"]:
            sys.stderr.write(f"rocketstore bench: workload failed: {f}\n")
        return 1
    return 0
