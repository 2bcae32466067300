"""The apache.rocketmq.v2 protobuf and gRPC modules, taken from the installed official client.

``rocketmq-python-client`` ships the generated modules as
``rocketmq.grpc_protocol``.  Importing them the ordinary way runs
``rocketmq/__init__.py``, which imports the whole client and configures a file
logger under ``~/logs``; a server needs none of that.  So the three modules are
loaded with temporary stand-ins for the two parent packages.  They keep their
real module names, so a later ``import rocketmq`` in the same process reuses
them instead of registering the same proto files twice (which protobuf refuses
with "duplicate symbol").
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from typing import Any

_NAMES = ("definition_pb2", "service_pb2", "service_pb2_grpc")
_PKG = "rocketmq.grpc_protocol"


def _load() -> tuple[Any, Any, Any]:
    if all(f"{_PKG}.{n}" in sys.modules for n in _NAMES):
        return tuple(sys.modules[f"{_PKG}.{n}"] for n in _NAMES)  # type: ignore[return-value]
    spec = importlib.util.find_spec("rocketmq")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the broker needs the official client's protocol modules: "
                          "pip install 'rocketmq-python-client>=5.1'")
    created: list[str] = []
    try:
        if "rocketmq" not in sys.modules:
            pkg = types.ModuleType("rocketmq")
            pkg.__path__ = list(spec.submodule_search_locations)
            sys.modules["rocketmq"] = pkg
            created.append("rocketmq")
        if _PKG not in sys.modules:
            sub = types.ModuleType(_PKG)
            sub.__path__ = [os.path.join(p, "grpc_protocol") for p in spec.submodule_search_locations]
            sys.modules[_PKG] = sub
            created.append(_PKG)
        mods = tuple(importlib.import_module(f"{_PKG}.{n}") for n in _NAMES)
    except Exception:
        for name in created:
            sys.modules.pop(name, None)
        created = []
        importlib.import_module(_PKG)  # the ordinary way, side effects and all
        mods = tuple(importlib.import_module(f"{_PKG}.{n}") for n in _NAMES)
    finally:
        for name in created:
            sys.modules.pop(name, None)
    return mods  # type: ignore[return-value]


pb, svc, svc_grpc = _load()
Code = pb.Code
