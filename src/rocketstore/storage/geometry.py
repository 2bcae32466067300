"""A store's geometry (its file sizes), measured from its files and checked against its config.

RocketMQ sizes every commitlog segment, consume-queue file and index file from
its config, and a file of another size does not load.  A store that already
has files therefore decides its own geometry: a key the config does not set
explicitly is measured from the files (the size most files have, so one torn
file does not decide), and a key set explicitly that contradicts the files
refuses the open before anything is touched.  ``allow_quarantine`` lets an
explicit value win: the files of the other size are then moved to quarantine.

The config of an open is ``<store>/broker.conf`` (written by ``rocketstore
init``) overlaid with the caller's config.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable

from ..paths import StorePaths
from ..config import CQ_UNIT_SIZE, MIN_COMMITLOG_FILE_SIZE, PRESETS, StoreConfig, read_conf_file, write_preset
from ..errors import ConfigError
from .quarantine import torn_last_segment
from .index import ENTRY_SIZE, HEADER_SIZE, SLOT_SIZE, index_file_size

log = logging.getLogger(__name__)

STORE_CONF = "broker.conf"  # the store's own config, in its root directory


@dataclass
class Measured:
    """The sizes of one kind of file: the files of each size."""

    paths: dict[int, list[str]]

    def count(self, size: int) -> int:
        return len(self.paths.get(size, ()))

    def example(self, size: int) -> str:
        return self.paths[size][0]

    def most_common(self) -> int:
        return max(self.paths, key=self.count)

    def majority(self, usable: Callable[[int], bool]) -> int | None:
        """The size most files have (ties: a usable size, then one every file name is a multiple of);
        None when that still does not decide."""
        names = [_name_offset(p) for ps in self.paths.values() for p in ps]

        def rank(size: int) -> tuple[int, bool, bool]:
            return self.count(size), usable(size), all(n % size == 0 for n in names)
        ranked = sorted(self.paths, key=rank, reverse=True)
        if len(ranked) > 1 and rank(ranked[0]) == rank(ranked[1]):
            return None
        return ranked[0]

    def agrees(self, size: int) -> bool:
        """Whether ``size`` is a size at least as many files have as any other."""
        return self.count(size) == self.count(self.most_common())

    def only(self, usable: Callable[[int], bool]) -> "Measured | None":
        """The files of the sizes ``usable`` accepts (None when no file is): a derived file (consume queue,
        index) of a size no geometry gives is torn, a file to rebuild from the commitlog, not a measure."""
        kept = {size: paths for size, paths in self.paths.items() if usable(size)}
        for size in set(self.paths) - set(kept):
            log.info("%s: %d bytes, a size no geometry gives (a torn file): not measured (the open names it, "
                     "and a writable one rebuilds it from the commitlog)", self.example(size), size)
        return Measured(kept) if kept else None

    def describe(self) -> str:
        sizes = sorted(self.paths, key=self.count, reverse=True)[:3]
        return ", ".join(f"{self.count(s)} of {s} bytes (e.g. {self.example(s)})" for s in sizes)


def _name_offset(path: str) -> int:
    name = os.path.basename(path)
    return int(name) if len(name) == 20 and name.isdigit() else 0


def _measure(paths: list[str]) -> Measured | None:
    by_size: dict[int, list[str]] = {}
    for p in paths:
        try:
            size = os.path.getsize(p)
        except OSError:
            continue
        if size:
            by_size.setdefault(size, []).append(p)
    return Measured(by_size) if by_size else None


def _listdir(d: str) -> list[str]:
    try:
        return sorted(os.listdir(d))
    except OSError:
        return []


def measure(root: str) -> dict[str, Measured]:
    """Sizes of the commitlog segments, consume-queue files and index files (empty files left out)."""
    out: dict[str, Measured] = {}
    cl = StorePaths(root).commitlog
    cq = StorePaths(root).consumequeue
    ix = os.path.join(root, "index")
    data = {"commitlog": [os.path.join(cl, n) for n in _listdir(cl) if len(n) == 20 and n.isdigit()],
            "consumequeue": [os.path.join(cq, t, q, n) for t in _listdir(cq) for q in _listdir(os.path.join(cq, t))
                             for n in _listdir(os.path.join(cq, t, q)) if len(n) == 20 and n.isdigit()],
            "index": [os.path.join(ix, n) for n in _listdir(ix) if len(n) == 17 and n.isdigit()]}
    for kind, paths in data.items():
        m = _measure(paths)
        if m is not None:
            out[kind] = m
    return out


def _without_torn_last_segment(m: Measured, file_size: int | None = None) -> Measured | None:
    """``m`` without the last commitlog segment when it is a torn last segment: shorter than ``file_size`` (when
    None, the size the other segments have), in its place (zeros alone too: see quarantine.torn_last_segment).
    The open extends it with zeros (extend_torn_last_segment), so
    it is no evidence of another geometry; the only segment is left in when ``file_size`` is None (nothing else
    tells the size)."""
    paths = [p for ps in m.paths.values() for p in ps]
    last = max(paths, key=_name_offset)
    if file_size is None:
        others = Measured({s: [p for p in ps if p != last] for s, ps in m.paths.items() if ps != [last]})
        if not others.paths:
            return m
        file_size = others.majority(lambda s: s >= MIN_COMMITLOG_FILE_SIZE)
        if file_size is None:
            return m
    size = os.path.getsize(last)
    base = _name_offset(last)
    follows = [p for p in paths if _name_offset(p) == base - file_size]
    if not 0 < size < file_size or base % file_size or (len(paths) > 1 and not follows) or \
            torn_last_segment(os.path.dirname(last), file_size) is None:
        return m
    kept = {s: [p for p in ps if p != last] for s, ps in m.paths.items()}
    kept = {s: ps for s, ps in kept.items() if ps}
    return Measured(kept) if kept else None


def _contradiction(setting: str, source: str, m: Measured, expected: int) -> ConfigError:
    size = m.most_common()
    return ConfigError(f"{setting} ({source}) contradicts the files: {m.example(size)}: file is {size} bytes, "
                       f"expected {expected}; refusing to open (leave the key out to use the files' size; a writable "
                       "command's --allow-quarantine moves the files of the other size to quarantine/)")


def _ambiguous(key: str, m: Measured) -> ConfigError:
    return ConfigError(f"{key}: cannot tell it from the files ({m.describe()}); set {key} explicitly")


def resolve_geometry(root: str, config: StoreConfig, *, allow_quarantine: bool = False) -> StoreConfig:
    """``config`` with the geometry keys it leaves unset measured from ``root``'s files; refuses contradictions."""
    files = measure(root)
    explicit = config.explicit
    changes: dict[str, int] = {}
    for key, kind, usable in (
            ("mappedFileSizeCommitLog", "commitlog", lambda s: s >= MIN_COMMITLOG_FILE_SIZE),
            ("mappedFileSizeConsumeQueue", "consumequeue", lambda s: s % CQ_UNIT_SIZE == 0)):
        m = files.get(kind)
        if m is not None and kind == "consumequeue":
            m = m.only(usable)
        if m is None:
            continue
        if key in explicit:
            value = getattr(config, key)
            if kind == "commitlog":
                m = _without_torn_last_segment(m, value)
                if m is None:
                    continue
            if not m.agrees(value) and not allow_quarantine:
                raise _contradiction(f"{key}={value}", explicit[key], m, value)
            continue
        if kind == "commitlog":
            m = _without_torn_last_segment(m) or m
        size = m.majority(usable)
        if size is None:
            raise _ambiguous(key, m)
        changes[key] = size
    m = files.get("index")
    if m is not None:
        m = m.only(lambda size: _index_size_fits(config, size))
    if m is not None:
        changes.update(_index_geometry(config, m, allow_quarantine))
    try:
        return config.inferred(**changes) if changes else config
    except ConfigError as e:
        raise ConfigError(f"{root}: cannot use the geometry of its files: {e}") from None


def _index_size_fits(config: StoreConfig, size: int) -> bool:
    """Whether an index file of ``size`` bytes fits a geometry the config allows: the keys it sets explicitly,
    RocketMQ's four entries a slot when it sets neither."""
    explicit = config.explicit
    rest = size - HEADER_SIZE
    if rest <= 0:
        return False
    if "maxHashSlotNum" in explicit and "maxIndexNum" in explicit:
        return rest % SLOT_SIZE == 0  # another geometry's whole file: a contradiction to report, not a torn file
    if "maxHashSlotNum" in explicit:
        rest -= SLOT_SIZE * config.maxHashSlotNum
        return rest > 0 and rest % ENTRY_SIZE == 0
    if "maxIndexNum" in explicit:
        rest -= ENTRY_SIZE * config.maxIndexNum
        return rest > 0 and rest % SLOT_SIZE == 0
    return size == index_file_size(config.maxHashSlotNum, config.maxIndexNum) or \
        rest % (SLOT_SIZE + 4 * ENTRY_SIZE) == 0


def _index_geometry(config: StoreConfig, m: Measured, allow_quarantine: bool) -> dict[str, int]:
    """maxHashSlotNum/maxIndexNum from the index file size: a key set explicitly fixes the other; with neither
    set, RocketMQ's ratio (four entries a slot) is assumed."""
    explicit = config.explicit
    slots_set, entries_set = "maxHashSlotNum" in explicit, "maxIndexNum" in explicit
    want = index_file_size(config.maxHashSlotNum, config.maxIndexNum)
    if slots_set and entries_set:
        if not m.agrees(want) and not allow_quarantine:
            raise _contradiction(f"maxHashSlotNum={config.maxHashSlotNum}, maxIndexNum={config.maxIndexNum}",
                                 explicit["maxIndexNum"], m, want)
        return {}
    size = m.majority(lambda s: True)
    if size is None:
        raise _ambiguous("maxIndexNum", m)
    if slots_set or entries_set:
        key = "maxHashSlotNum" if slots_set else "maxIndexNum"
        rest = size - HEADER_SIZE - (SLOT_SIZE if slots_set else ENTRY_SIZE) * getattr(config, key)
        unit = ENTRY_SIZE if slots_set else SLOT_SIZE
        if rest <= 0 or rest % unit:
            if allow_quarantine:
                return {}
            raise _contradiction(f"{key}={getattr(config, key)}", explicit[key], m, want)
        return {"maxIndexNum" if slots_set else "maxHashSlotNum": rest // unit}
    if size == want:
        return {}
    if size <= HEADER_SIZE or (size - HEADER_SIZE) % (SLOT_SIZE + 4 * ENTRY_SIZE):
        raise ConfigError(f"maxHashSlotNum/maxIndexNum: {m.example(size)} is {size} bytes, which does not fit "
                          "RocketMQ's four entries a slot; set both keys explicitly")
    slots = (size - HEADER_SIZE) // (SLOT_SIZE + 4 * ENTRY_SIZE)
    return {"maxHashSlotNum": slots, "maxIndexNum": 4 * slots}


def configured(root: str, config: StoreConfig | None = None) -> StoreConfig:
    """``<root>/broker.conf`` overlaid with ``config``, geometry not yet measured: what a tool may read before
    the files are (e.g. whether the store names its tier)."""
    own = os.path.join(root, STORE_CONF)
    cfg = StoreConfig.load(own) if os.path.isfile(own) else None
    if cfg is None:
        return config or StoreConfig()
    return cfg if config is None else cfg.overlay(config)


def store_config(root: str, config: StoreConfig | None = None, *, allow_quarantine: bool = False) -> StoreConfig:
    """The config an open of ``root`` uses: ``<root>/broker.conf`` overlaid with ``config``, geometry resolved."""
    return resolve_geometry(root, configured(root, config), allow_quarantine=allow_quarantine)


def init_store(root: str, preset: str = "default") -> bool:
    """Create a store directory whose ``broker.conf`` holds a preset geometry (see config.PRESETS).

    Returns False when ``root`` already is a store made with that preset; refuses any other
    non-empty directory (its files, not a new config, decide its geometry).
    """
    if preset not in PRESETS:
        raise ConfigError(f"preset {preset!r}: expected one of {', '.join(sorted(PRESETS))}")
    if os.path.exists(root) and not os.path.isdir(root):
        raise ConfigError(f"{root}: not a directory; refusing to initialise it")
    conf = os.path.join(root, STORE_CONF)
    entries = [e for e in os.listdir(root) if not e.startswith(".")] if os.path.isdir(root) else []
    if entries:
        if os.path.isfile(conf) and read_conf_file(conf) == {k: str(v) for k, v in PRESETS[preset].items()}:
            return False
        raise ConfigError(f"{root}: not empty ({', '.join(sorted(entries)[:3])}) and not a store made with "
                          f"preset {preset}; refusing to initialise it")
    os.makedirs(root, exist_ok=True)
    write_preset(conf, preset)
    return True


def reserved_bytes(root: str) -> dict[str, int]:
    """Disk space the store's files hold (allocated blocks): segments and index files are allocated whole
    when created, so this is what the store reserves, written or not."""
    out = {}
    for kind in ("commitlog", "consumequeue", "index"):
        total = 0
        for d, _dirs, names in os.walk(os.path.join(root, kind)):
            for n in names:
                try:
                    total += os.stat(os.path.join(d, n)).st_blocks * 512
                except OSError:
                    pass
        out[kind] = total
    out["total"] = sum(out.values())
    return out
