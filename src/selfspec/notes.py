"""The library's progress notes on stderr, the one mechanism the CLI and :func:`selfspec.load` share.

The library logs what it does on the ``selfspec`` logger (what ``auto`` measures and chooses, cost
profiles, downloads, conversions). A program with its own ``logging`` set-up gets them there; the CLI,
and ``load()`` in a terminal where nothing was configured, show them as ``selfspec: ...`` lines while
they run, then put the logger back as it was.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator

LOGGER = "selfspec"


@contextlib.contextmanager
def notes_on_stderr() -> Iterator[Callable[[bool], None]]:
    """While the block runs: the ``selfspec.*`` loggers' notes and warnings as ``selfspec: ...``
    lines on whatever ``sys.stderr`` is when the message comes (tests replace it), and not passed
    on to other handlers (no duplicates where something configured the root logger). Yields
    ``set_quiet(quiet)``: warnings only. Restored afterwards, so a program keeps its own set-up."""

    class Stderr(logging.StreamHandler):
        def emit(self, record: logging.LogRecord) -> None:
            self.stream = sys.stderr
            super().emit(record)

    logger = logging.getLogger(LOGGER)
    saved = logger.level, logger.propagate
    handler = Stderr()
    handler.setFormatter(logging.Formatter("selfspec: %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        yield lambda quiet: logger.setLevel(logging.WARNING if quiet else logging.INFO)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


def show_progress(progress: bool | None) -> bool:
    """Whether :func:`selfspec.load` shows its notes: ``progress`` where given; None: when stderr is a
    terminal and nothing handles the ``selfspec`` logger yet (no handler on it or above it: a
    program that configured ``logging`` reads them there)."""
    if progress is not None:
        return progress
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty()) and not logging.getLogger(LOGGER).hasHandlers()
