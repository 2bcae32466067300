"""Issue 17: the examples in README.md and docs/*.md work as written.

Conventions (documented here, relied on by the docs):

* A fenced ```sh block is run with bash (``set -euo pipefail``) in a temporary
  directory holding ``demo-store`` (a small ``make demo`` store) and ``broker.conf``
  (README's ```properties block), with ``rocketstore`` and ``.venv/bin/rocketstore``
  running this checkout.
* A fenced ```python block is run in a fresh interpreter in that directory; paths
  under ``/data/`` are moved into the temporary directory.
* A block preceded by ``<!-- no-test: reason -->`` is not run (Spark, a broker, a
  cluster, a fragment): its Python must compile, and its ``rocketstore`` command
  lines must parse and its ``make`` targets exist, as for every other block.
* ```console blocks are transcripts: their ``$ rocketstore ...`` lines must parse.
* Every inline ```rocketstore ...``` synopsis must parse with the real argument
  parser: without its optional ``[...]`` parts, with all of them, and with each
  one (and each ``a | b`` alternative) alone.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Iterator, NamedTuple

import pytest

from rocketstore.cli.main import build_parser
from rocketstore.config import StoreConfig

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
EXE = ("rocketstore", ".venv/bin/rocketstore")

# Example values for the placeholders of the synopses.
PLACEHOLDERS = {"STORE": "store", "T": "TopicA", "Q": "0", "N": "1", "MS": "0", "K": "key", "S": "1",
                "TEXT": "hello", "F": "file", "FILE": "file", "DIR": "dir", "PEM": "x.pem", "TIME": "-1h",
                "G": "GroupA", "MSGID": "7F00000100002A9F0000000000000000"}


class Block(NamedTuple):
    doc: Path
    line: int
    lang: str
    text: str
    no_test: str | None  # the reason given by a <!-- no-test: ... --> comment right above it

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}"


def blocks(doc: Path) -> Iterator[Block]:
    lines = doc.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        marker = re.match(r"^<!--\s*no-test:\s*(.+?)\s*-->\s*$", lines[i - 1]) if i else None
        yield Block(doc, i + 1, m.group(1), "\n".join(lines[i + 1:end]), marker.group(1) if marker else None)
        i = end + 1


ALL_BLOCKS = [b for doc in DOCS for b in blocks(doc)]


def _ids(items):
    return [b.where for b in items]


# ---------------------------------------------------------------- parsing with the real parser

def parse_error(argv: list[str]) -> str | None:
    """The parser's complaint about ``rocketstore argv``, or None when it parses."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            build_parser().parse_args(argv)
        except SystemExit as e:
            return None if e.code == 0 else err.getvalue().strip() or f"exit {e.code}"
    return None


def is_command_path(argv: list[str]) -> bool:
    """``spark`` or ``admin delete-expired`` (or nothing): a mention of a command, not an invocation."""
    parser = build_parser()
    for word in argv:
        sub = next((a for a in parser._actions if hasattr(a, "choices") and isinstance(a.choices, dict)
                    and word in a.choices), None)
        if sub is None:
            return False
        parser = sub.choices[word]
    return True


def shell_commands(text: str, transcript: bool = False) -> Iterator[list[str]]:
    """The argv (after the program) of every ``rocketstore`` command in shell text (of a transcript: its
    ``$ `` lines)."""
    text = re.sub(r"\\\n\s*", " ", text)
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("$ "):
            line = line[2:]
        elif transcript or not line or line.startswith("#"):
            continue
        if not re.search(r"(^|[\s/])rocketstore\s", line):
            continue
        lex = shlex.shlex(line, posix=True, punctuation_chars="|&;<>")
        lex.whitespace_split = True
        segment: list[str] = []
        for tok in [*lex, ";"]:
            if tok and set(tok) <= set("|&;<>"):
                if segment and segment[0] in EXE:
                    yield segment[1:]
                segment = [] if tok != ">" else ["(redirect)"]
            elif segment[:1] != ["(redirect)"]:
                segment.append(tok)


class Choice(list):
    """``a|b`` (no spaces): one of the alternatives is required."""


class Optional(list):
    """``[...]``, alternatives split by `` | ``: at most one, or none."""


def synopsis_variants(span: str) -> list[list[str]]:
    """Concrete command lines for a synopsis such as ``dump STORE [--topic T] [--limit N | --max-messages N]``.

    Omitting every optional part, taking all of them, and taking each one (each alternative) alone.
    """
    span = re.sub(r"\s\\?\|\s", " \u00a6 ", span).replace("\\|", "|")  # spaced bars split sequences
    lex = shlex.shlex(span, posix=True, punctuation_chars="[]()|\u00a6")
    lex.whitespace_split = True
    # shlex runs punctuation together ("]]" of a nested group): one token per bracket or bar
    toks = [c for t in lex if t != "..." for c in ([*t] if set(t) <= set("[]()|\u00a6") else [t])]

    def parse(i: int, close: str | None) -> tuple[list[list], int]:
        alts: list[list] = [[]]
        while i < len(toks):
            t = toks[i]
            if t == close:
                return alts, i + 1
            if t == "[":
                group, i = parse(i + 1, "]")
                alts[-1].append(Optional(group))
                continue
            if t == "(":  # ``(a | b)``: exactly one of the alternatives
                group, i = parse(i + 1, ")")
                alts[-1].append(Choice(group))
                continue
            if t == "\u00a6":
                alts.append([])
            elif t == "|" and alts[-1] and i + 1 < len(toks):
                prev = alts[-1].pop()
                choice = prev if isinstance(prev, Choice) else Choice([[prev]])
                choice.append([PLACEHOLDERS.get(toks[i + 1], toks[i + 1])])
                alts[-1].append(choice)
                i += 1
            else:
                alts[-1].append(PLACEHOLDERS.get(t, t))
            i += 1
        assert close is None, f"unclosed {'[' if close == ']' else '('} in {span!r}"
        return alts, i

    top, _ = parse(0, None)

    def render(seq: list, pick: dict[int, int | None], full: bool) -> list[str]:
        out: list[str] = []
        for node in seq:
            if isinstance(node, str):
                out.append(node)
                continue
            choice = pick.get(id(node), 0 if full or isinstance(node, Choice) else None)
            if choice is not None:
                out += render(node[choice], pick, full)
        return out

    variants: list[list[str]] = []
    for alt in top:
        picks = [({}, False), ({}, True)]
        # each optional part alone; each a|b choice with everything else included (it may sit inside one)
        picks += [({id(g): k}, isinstance(g, Choice)) for g in _all_groups(alt) for k in range(len(g))]
        for pick, full in picks:
            v = render(alt, pick, full)
            if v not in variants:
                variants.append(v)
    return variants


def _all_groups(seq: list) -> Iterator[list]:
    for node in seq:
        if not isinstance(node, str):
            yield node
            for alt in node:
                yield from _all_groups(alt)


def inline_synopses() -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for m in re.finditer(r"`((?:\.venv/bin/)?rocketstore [^`]+)`", text):
            line = text[:m.start()].count("\n") + 1
            out.append((f"{doc.relative_to(REPO)}:{line}", m.group(1)))
    return out


@pytest.mark.parametrize("where,span", inline_synopses(), ids=[w for w, _ in inline_synopses()])
def test_every_inline_command_parses(where, span):
    for variant in synopsis_variants(span.split(" ", 1)[1]):
        if is_command_path(variant):
            continue
        err = parse_error(variant)
        if err and "invalid" in err:  # a placeholder not in PLACEHOLDERS may stand for a number
            err = parse_error([re.sub(r"^[A-Z][A-Z0-9_]*$", "0", t) for t in variant])
        assert err is None, f"{where}: `{span}` as `rocketstore {shlex.join(variant)}`: {err}"


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=_ids(ALL_BLOCKS))
def test_every_command_line_in_a_block_parses(block):
    for argv in shell_commands(block.text, block.lang != "sh") if block.lang in ("sh", "console", "") else []:
        if is_command_path(argv):
            continue
        err = parse_error(argv)
        assert err is None, f"{block.where}: `rocketstore {shlex.join(argv)}`: {err}"


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.lang == "sh"],
                         ids=_ids([b for b in ALL_BLOCKS if b.lang == "sh"]))
def test_make_targets_in_docs_exist(block):
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
    for name in re.findall(r"^\s*make ([\w-]+)", block.text, re.M):
        assert name in targets, f"{block.where}: make {name}: no such target"


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.lang == "python"],
                         ids=_ids([b for b in ALL_BLOCKS if b.lang == "python"]))
def test_every_python_block_compiles(block):
    compile(block.text, block.where, "exec")


def test_the_configuration_example_loads(tmp_path):
    props = [b for b in ALL_BLOCKS if b.lang == "properties"]
    assert props
    for b in props:
        (tmp_path / "broker.conf").write_text(b.text + "\n")
        StoreConfig.load(str(tmp_path / "broker.conf"))


def test_no_block_is_skipped_without_a_reason():
    for b in ALL_BLOCKS:
        if b.lang in ("sh", "python"):
            assert b.no_test is None or len(b.no_test) > 10, f"{b.where}: say why it is not run"


def test_bench_smoke_duration_is_the_same_in_help_and_docs():
    row = next(line for line in (REPO / "docs" / "bench.md").read_text().splitlines()
               if line.startswith("| `make bench-smoke`"))
    duration = row.rstrip(" |").rsplit("|", 1)[1].strip()
    bench = next(a for a in build_parser()._actions if hasattr(a, "choices") and isinstance(a.choices, dict))
    smoke = next(a for a in bench.choices["bench"]._actions if "--smoke" in a.option_strings)
    assert duration in smoke.help, (duration, smoke.help)


# ---------------------------------------------------------------- running the runnable blocks

@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A directory with a small demo-store, broker.conf and ``rocketstore`` on PATH."""
    d = tmp_path_factory.mktemp("docs")
    env = {**os.environ, "ROCKETSTORE_DEMO_DIR": str(d / "demo-store"), "ROCKETSTORE_DEMO_MESSAGES": "2000"}
    subprocess.run([sys.executable, "-m", "rocketstore.cli.demo"], env=env, cwd=d, check=True, capture_output=True,
                   timeout=120)
    props = next(b for b in ALL_BLOCKS if b.lang == "properties")
    (d / "broker.conf").write_text(props.text + "\n")
    shim = f'#!/bin/sh\nexec "{sys.executable}" -m rocketstore "$@"\n'
    for where in (d / "bin", d / ".venv" / "bin"):
        where.mkdir(parents=True)
        (where / "rocketstore").write_text(shim)
        (where / "rocketstore").chmod(0o755)
    return d


def _env(workdir: Path) -> dict[str, str]:
    return {**os.environ, "PATH": f"{workdir / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}


RUNNABLE_SH = [b for b in ALL_BLOCKS if b.lang == "sh" and b.no_test is None]
RUNNABLE_PY = [b for b in ALL_BLOCKS if b.lang == "python" and b.no_test is None]


@pytest.mark.parametrize("block", RUNNABLE_SH, ids=_ids(RUNNABLE_SH))
def test_shell_examples_run(block, workdir):
    r = subprocess.run(["bash", "-c", "set -euo pipefail\n" + block.text], cwd=workdir, env=_env(workdir),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{block.where}:\n{r.stderr[-3000:]}"
    assert "Traceback" not in r.stderr and "error" not in r.stderr.lower(), f"{block.where}:\n{r.stderr[-3000:]}"


@pytest.mark.parametrize("block", RUNNABLE_PY, ids=_ids(RUNNABLE_PY))
def test_python_examples_run(block, workdir):
    code = block.text.replace('"/data/', f'"{workdir}/data/')
    assert not re.search(r"""["']/(?!%s)""" % re.escape(str(workdir).lstrip("/")), code), \
        f"{block.where}: a runnable example must not touch absolute paths outside /data/"
    r = subprocess.run([sys.executable, "-c", code], cwd=workdir, env=_env(workdir), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, f"{block.where}:\n{r.stderr[-3000:]}"


def test_some_examples_are_run():
    assert len(RUNNABLE_SH) >= 1 and len(RUNNABLE_PY) >= 1
