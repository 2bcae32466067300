"""The house rule (README "Layout of the code"): imports point one way, from a layer to the layers below it.

Three checks, each able to fail (the last test shows the two AST checks catching planted faults):

* import-linter's ``layers`` contract in pyproject.toml ([tool.importlinter]), TYPE_CHECKING imports included;
* nothing below the facade (``store.py``) names ``MessageStore``: the services, recovery and the tier are
  given a ``StoreFiles``, never the facade;
* no module reads another module's ``_private`` names.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

PKG = REPO / "src" / "rocketstore"
BELOW_FACADE = ("recovery", "tier", "services", "storage", "format", "config.py", "errors.py", "paths.py")


def modules(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def names_of_facade(root: Path, below: tuple[str, ...]) -> list[str]:
    """``file:line`` of every place below the facade whose code (not its docstrings) names MessageStore."""
    out = []
    for p in modules(root):
        if p.relative_to(root).parts[0] not in below:
            continue
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            named = (isinstance(node, ast.Name) and node.id == "MessageStore") or \
                (isinstance(node, ast.Attribute) and node.attr == "MessageStore") or \
                (isinstance(node, ast.ImportFrom) and any(a.name == "MessageStore" for a in node.names)) or \
                (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.strip('"') ==
                 "MessageStore")  # a string annotation
            if named:
                out.append(f"{p.relative_to(root.parent)}:{node.lineno}")
    return out


def _own_names(tree: ast.AST) -> set[str]:
    own: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(n.name)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            own.add(n.attr)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            own.add(n.id)
        elif isinstance(n, ast.arg):
            own.add(n.arg)
        elif isinstance(n, ast.alias):
            own.add(n.asname or n.name.split(".")[0])
    return own


def private_reads(root: Path) -> list[str]:
    """``file:line: name`` where a module reads a ``_private`` name that another module of the package defines
    (and it does not): ``other._name`` or ``from .mod import _name`` (``self._name`` is the object's own).  Private names of the standard library
    (argparse's ``_SubParsersAction``) are not the package's to police."""
    trees = {p: ast.parse(p.read_text(encoding="utf-8")) for p in modules(root)}
    own = {p: _own_names(t) for p, t in trees.items()}
    defined_somewhere: set[str] = set().union(*own.values()) if own else set()
    out = []
    for p, tree in trees.items():
        for n in ast.walk(tree):
            names = []
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) and \
                    not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")):
                names = [n.attr]  # an object's own state (a mixin's self._x) is not another module's
            elif isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").startswith(root.name)):
                names = [a.name for a in n.names]
            for name in names:
                if name.startswith("_") and not name.startswith("__") and name not in own[p] and \
                        name in defined_somewhere:
                    out.append(f"{p.relative_to(root.parent)}:{n.lineno}: {name}")
    return out


def test_import_contract_holds() -> None:
    code = ("import sys; from importlinter.cli import lint_imports; "
            "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))")
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "1 kept, 0 broken" in r.stdout, r.stdout[-2000:]


def test_nothing_below_the_facade_names_it() -> None:
    assert names_of_facade(PKG, BELOW_FACADE) == []


def test_no_module_reads_another_modules_private_names() -> None:
    assert private_reads(PKG) == []


@pytest.mark.parametrize("check", ["facade", "private"])
def test_the_checks_catch_a_planted_fault(tmp_path: Path, check: str) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "services").mkdir(parents=True)
    (pkg / "store.py").write_text("class MessageStore:\n    def __init__(self):\n        self._table = {}\n")
    if check == "facade":
        (pkg / "services" / "flush.py").write_text(
            '"""Given the files, never the MessageStore."""\nfrom typing import TYPE_CHECKING\n'
            'if TYPE_CHECKING:\n    from ..store import MessageStore\n\n\ndef f(store: "MessageStore"):\n    pass\n')
        assert [x.split(":")[1] for x in names_of_facade(pkg, ("services",))] == ["4", "7"]
    else:
        (pkg / "services" / "clean.py").write_text("def f(store):\n    return store._table.get(1)\n")
        assert private_reads(pkg) == ["pkg/services/clean.py:2: _table"]
