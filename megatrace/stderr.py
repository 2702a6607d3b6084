"""The command line's standard error while a dataflow runs.

Bytewax reports an exception raised inside a dataflow as a panic of its Rust
worker: a few lines, or a hundred with ``RUST_BACKTRACE`` set, printed before the
Python exception comes back to the command. When the command can say what went
wrong in one line (the broker stayed away, ClickHouse could not take inserts) that
report is noise. :class:`PanicFilter` passes standard error through a pipe, holds
back each panic report, and at the end either drops them (the command explained the
error) or prints them (it did not: they are the diagnosis).

>>> held = _Held()
>>> for line in ["warning: x", "thread '<unnamed>' panicked at src/outputs.rs:364:37:",
...              "Box<dyn Any>", "stack backtrace:", "   0: std::panicking::begin_panic",
...              "             at /rustc/x.rs:1:2", "warning: y"]:
...     held.feed(line)
['warning: x']
[]
[]
[]
[]
[]
['warning: y']
>>> len(held.panics)
5
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_PANIC = re.compile(r"^thread '.*' panicked at ")
_PANIC_BODY = re.compile(
    r"^(Box<dyn Any>|stack backtrace:|note: |\s+\d+: |\s+at |"
    r"panic in a destructor|thread caused non-unwinding panic)"
)


class _Held:
    """Lines in, lines to print out; panic reports held in :attr:`panics`."""

    def __init__(self) -> None:
        self.panics: list[str] = []
        self._inside = False

    def feed(self, line: str) -> list[str]:
        if _PANIC.match(line):
            self._inside = True
        elif self._inside and not _PANIC_BODY.match(line):
            self._inside = False
        if self._inside:
            self.panics.append(line)
            return []
        return [line]


@contextmanager
def panic_filter() -> Iterator[_Held]:
    """Standard error through a filter that holds back panic reports (see the module
    docstring); the caller decides with :func:`release` whether they are printed."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (a test runner's)
        yield _Held()
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    read_end, write_end = os.pipe()
    os.dup2(write_end, fd)
    os.close(write_end)
    held = _Held()

    def pump() -> None:
        with os.fdopen(read_end, "r", errors="replace") as pipe:
            for line in pipe:
                for out in held.feed(line.rstrip("\n")):
                    os.write(saved, (out + "\n").encode())

    thread = threading.Thread(target=pump, name="megatrace-stderr", daemon=True)
    thread.start()
    try:
        yield held
    finally:
        sys.stderr.flush()
        os.dup2(saved, fd)  # the pipe's last writer closes: the pump reads to its end
        thread.join(5)
        held.saved_fd = saved  # type: ignore[attr-defined]


def release(held: _Held, explained: bool) -> None:
    """Print the held panic reports unless the error was explained in one line."""
    fd = getattr(held, "saved_fd", None)
    if held.panics and not explained:
        sys.stderr.write("\n".join(held.panics) + "\n")
        sys.stderr.flush()
    held.panics.clear()
    if fd is not None:
        os.close(fd)
        held.saved_fd = None  # type: ignore[attr-defined]


__all__ = ["panic_filter", "release"]
