"""Follow growing files: what was appended since last time, in whole lines.

>>> import tempfile, pathlib
>>> p = pathlib.Path(tempfile.mkdtemp()) / "a.log"
>>> _ = p.write_bytes(b"one\\ntw")
>>> offsets = {}
>>> new_lines(p, offsets)
b'one\\n'
>>> _ = p.write_bytes(b"one\\ntwo\\n")
>>> new_lines(p, offsets)
b'two\\n'
"""

from __future__ import annotations

import os


def new_lines(path: str | os.PathLike[str], offsets: dict[str, int]) -> bytes:
    """The whole lines appended to ``path`` since the offset recorded in ``offsets``
    (updated); a file that shrank (truncated or replaced) is read again from the start."""
    key = str(path)
    size = os.path.getsize(path)
    start = offsets.get(key, 0)
    if size < start:
        start = 0
    if size == start:
        return b""
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(size - start)
    end = data.rfind(b"\n") + 1  # a partial last line waits for its end
    offsets[key] = start + end
    return data[:end]


__all__ = ["new_lines"]
