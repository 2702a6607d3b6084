"""Input files as they are found: plain, or compressed as people keep and send them.

Logs and dumps copied off a cluster are often gzipped (``rank_0.log.gz``), or bzip2- or
xz-compressed; a dump renamed on the way keeps no suffix. A file is told by its first
bytes, never by its name, and read decompressed by every reader (call logs, training
logs, throughput CSVs, configurations, Flight Recorder dumps, Kineto traces, the NCCL
Inspector's output, JSON-lines records). A compressed file cut short (a copy that was
interrupted) or damaged is an :class:`InputFileError` that names it; so is a format the
standard library cannot read (zstd, a zip archive), with the command that unpacks it. A
tar archive of a run's folder, as a run is shipped, is unpacked (:func:`unpack`).

>>> import gzip, pathlib, tempfile
>>> p = pathlib.Path(tempfile.mkdtemp()) / "rank_0.log"
>>> _ = p.write_bytes(gzip.compress(b"[1.5] [Rank 0] Fun AllReduce Data 1\\n"))
>>> compression(p), read_text(p)[:14]
('gzip', '[1.5] [Rank 0]')
>>> _ = p.write_bytes(gzip.compress(bytes(range(256)) * 64)[:200])  # a copy cut short
>>> try:
...     read_bytes(p)
... except InputFileError as e:
...     print(str(e).split(": ", 1)[1].split(" (")[0])
a gzip file cut short or damaged
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import tarfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

#: first bytes -> the compression they begin (read by the standard library)
_READ = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz"}
#: first bytes of formats it cannot read -> what unpacks them
_UNREAD = {b"\x28\xb5\x2f\xfd": ("zstd", "zstd -d"), b"PK\x03\x04": ("zip", "unzip")}
_OPEN = {"gzip": gzip.open, "bzip2": bz2.open, "xz": lzma.open}
#: what a damaged or truncated stream raises as it is read, by library (a plain file's
#: reading errors are OSError too)
STREAM_ERRORS = (EOFError, OSError, zlib.error, lzma.LZMAError)
#: the suffixes of the compressions read
_SUFFIXES = (".gz", ".bz2", ".xz")


class InputFileError(ValueError):
    """A file that cannot be read as it is: compressed and cut short or damaged, or in a
    compression only another tool unpacks (``path``, and ``why``)."""

    def __init__(self, path: str | Path, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.path, self.why = str(path), why


def compression(path: str | Path) -> str | None:
    """The compression ``path`` is in (``gzip``, ``bzip2``, ``xz``), None for a plain
    file; one this module cannot read raises :class:`InputFileError`."""
    with open(path, "rb") as fh:
        head = fh.read(6)
    for magic, name in _READ.items():
        if head.startswith(magic):
            return name
    for magic, (name, tool) in _UNREAD.items():
        if head.startswith(magic):
            raise InputFileError(path, f"a {name} file: unpack it first ({tool} {path})")
    return None


def inner_suffix(path: str | Path) -> str:
    """The suffix of what ``path`` holds, its compression's left out (``.csv`` for
    ``a.csv.gz``): what it is named as, where its name is all there is to go by."""
    p = Path(path)
    return Path(p.stem).suffix if p.suffix in _SUFFIXES else p.suffix


def open_binary(path: str | Path) -> IO[bytes]:
    """``path`` opened for reading, decompressed as it is read where it is compressed
    (a damaged stream raises as it is met: use :func:`read_bytes`, :func:`lines` or
    :func:`text_lines`, which say so)."""
    return _open(path, compression(path))


def _open(path: str | Path, kind: str | None) -> IO[bytes]:
    return _OPEN[kind](path, "rb") if kind else open(path, "rb")  # type: ignore[return-value]


def open_text(path: str | Path) -> IO[str]:
    """``path`` as text (UTF-8, undecodable bytes replaced, universal newlines, as
    :func:`open` reads it), decompressed where it is."""
    return io.TextIOWrapper(open_binary(path), encoding="utf-8", errors="replace")


def read_bytes(path: str | Path) -> bytes:
    """The whole content of ``path``, decompressed."""
    kind = compression(path)
    if kind is None:
        return Path(path).read_bytes()
    try:
        with _OPEN[kind](path, "rb") as fh:
            return fh.read()
    except STREAM_ERRORS as e:
        raise _damaged(path, kind, e) from None


def read_text(path: str | Path, newline: str | None = None) -> str:
    """The whole content of ``path`` as text (UTF-8, undecodable bytes replaced; newlines
    as :func:`open` reads them with ``newline``), decompressed."""
    if compression(path) is None:
        with open(path, encoding="utf-8", errors="replace", newline=newline) as fh:
            return fh.read()
    data = io.BytesIO(read_bytes(path))
    return io.TextIOWrapper(data, encoding="utf-8", errors="replace", newline=newline).read()


def lines(path: str | Path) -> Iterator[bytes]:
    """The lines of ``path`` (with their ends), decompressed as they are read."""
    return _lines(path, text=False)


def text_lines(path: str | Path) -> Iterator[str]:
    """The lines of ``path`` as text (as :func:`open_text` reads them), decompressed as
    they are read."""
    return _lines(path, text=True)


def _lines(path: str | Path, text: bool) -> Iterator[Any]:
    kind = compression(path)
    fh = _open(path, kind)
    with io.TextIOWrapper(fh, encoding="utf-8", errors="replace") if text else fh as f:
        try:
            yield from f
        except STREAM_ERRORS as e:
            if kind is None:
                raise
            raise _damaged(path, kind, e) from None


def is_archive(path: str | Path) -> bool:
    """Whether ``path`` is a tar archive (of a run's folder, as one is shipped), compressed
    or not."""
    try:
        return Path(path).is_file() and tarfile.is_tarfile(path)
    except (tarfile.TarError, *STREAM_ERRORS):
        return False


def unpack(path: str | Path, into: Path) -> Path:
    """The tar archive ``path`` unpacked into ``into`` (a member that would land outside
    it, or be a device or a link out of it, refused: tarfile's ``data`` filter): the one
    folder it holds, else ``into``."""
    try:
        with tarfile.open(path) as t:
            t.extractall(into, filter="data")
    except (tarfile.TarError, *STREAM_ERRORS) as e:
        raise InputFileError(path, f"an archive that cannot be unpacked ({e})") from None
    entries = list(into.iterdir())
    return entries[0] if len(entries) == 1 and entries[0].is_dir() else into


def _damaged(path: str | Path, kind: str, e: BaseException) -> InputFileError:
    return InputFileError(path, f"a {kind} file cut short or damaged ({e})")


__all__ = [
    "STREAM_ERRORS",
    "InputFileError",
    "compression",
    "inner_suffix",
    "is_archive",
    "lines",
    "open_binary",
    "open_text",
    "read_bytes",
    "read_text",
    "text_lines",
    "unpack",
]
