"""Progress bars for long work: tqdm on stderr, shown only to a person at a terminal."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator

from tqdm import tqdm


@contextmanager
def progress_bar(total: int, desc: str, unit: str = "it", min_total: int = 0) -> Iterator[tqdm]:
    """A bar over ``total`` units; silent when stderr is not a TTY or the work is small."""
    disable = not sys.stderr.isatty() or total < min_total
    bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=True, disable=disable, file=sys.stderr, leave=False)
    try:
        yield bar
    finally:
        bar.close()
