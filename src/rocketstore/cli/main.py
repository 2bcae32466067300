"""The ``rocketstore`` command: a thin layer over the Python API.

JSON goes to stdout (one object, or one per line for streams of messages);
logs and problems go to stderr.  Errors exit with status 2 and one line on
stderr, never a traceback; ``verify`` exits 1 when it finds problems.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import select
import sys
from typing import Any, Callable, NoReturn

from .. import __version__
from ..config import StoreConfig
from ..errors import StoreError
from .timeparse import NEGATIVE_VALUE

log = logging.getLogger("rocketstore")

# Subcommands that live in other modules: (module, function that adds them to the subparsers).
PLUGINS = [
    ("rocketstore.cli.store", "register"),
    ("rocketstore.cli.admin", "register"),
    ("rocketstore.cli.dlq", "register"),
    ("rocketstore.cli.tier", "register"),
    ("rocketstore.spark.cli", "register"),
    ("rocketstore.broker.cli", "register"),
    ("rocketstore.bench.cli", "register"),
]


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._negative_number_matcher = NEGATIVE_VALUE  # "-1h" is a value (a relative time), as "-5" is

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"rocketstore: error: {message}\n")
        raise SystemExit(2)


def emit(obj: Any) -> None:
    """One JSON document on stdout."""
    sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")


def load_config(path: str | None) -> StoreConfig | None:
    return StoreConfig.load(path) if path else None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rocketstore", description="RocketMQ-compatible message store tools")
    parser.add_argument("-v", "--verbose", action="count", default=0, help=VERBOSE_HELP)
    parser.add_argument("--version", action="version", version=f"rocketstore {__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for module, func in PLUGINS:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and (e.name == module or module.startswith(e.name + ".")):
                continue  # that part is not installed in this build
            raise
        getattr(mod, func)(sub)
    _verbose_everywhere(sub)
    return parser


VERBOSE_HELP = "more logging on stderr (-vv for debug)"


def _verbose_everywhere(sub: argparse._SubParsersAction) -> None:
    """Accept ``-v`` after the command too (``rocketstore serve STORE -v``), not only before it."""
    for p in sub.choices.values():
        nested = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        for a in nested:
            _verbose_everywhere(a)
        if not nested and "-v" not in p._option_string_actions:
            # SUPPRESS: absent after the command, the count given before it stands
            p.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS, help=VERBOSE_HELP)


def _stdout_reader_gone() -> bool:
    """True when stdout is a pipe whose reader has exited (``rocketstore dump STORE | head``)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    handler: Callable[[argparse.Namespace], int | None] = args.handler
    try:
        status = handler(args) or 0
        sys.stdout.flush()  # inside the try: a reader that has gone is seen here, not at exit
        return status
    except BrokenPipeError as e:
        if not _stdout_reader_gone():
            sys.stderr.write(f"rocketstore: error: {e}\n")
            return 2
        # The reader of our output has gone (``| head``): stop quietly, as Unix tools do, and keep
        # the interpreter's final flush from failing again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (StoreError, OSError) as e:
        text = str(e) if not isinstance(e, OSError) or not e.filename else f"{e.filename}: {e.strerror}"
        sys.stderr.write(f"rocketstore: error: {text}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("rocketstore: interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
