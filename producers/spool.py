"""A bounded on-disk queue: what the node agent accepted and has not yet delivered.

Entries are appended to segment files as frames (``length, crc32, payload``)
and read back in order from a cursor that only moves when the caller says the
entries were delivered (:meth:`Spool.commit`). The cursor is written
atomically (write, fsync, rename), consumed segments are deleted, and a torn
frame at the end of the last segment (a crash mid-write) is cut off at open.
So an agent that crashes, or a broker that is down for an hour, loses nothing
that was appended, and delivery resumes in order; an entry may be delivered
twice (after a crash between delivery and commit), which the idempotent sinks
absorb.

When appending would exceed ``max_bytes`` the entry is refused and counted
(:attr:`Spool.dropped`): the caller says so loudly.

>>> import tempfile
>>> sp = Spool(tempfile.mkdtemp(), max_bytes=1 << 20)
>>> sp.append([b"a", b"bb", b"ccc"])
3
>>> batch = sp.read(2)
>>> [p for p, _ in batch]
[b'a', b'bb']
>>> sp.commit(batch[-1][1]); [p for p, _ in sp.read(10)]
[b'ccc']
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterable
from pathlib import Path

_HEADER = struct.Struct("<II")  # payload length, crc32
Position = tuple[int, int]  # (segment number, byte offset after the entry)


class SpoolError(RuntimeError):
    """The spool directory cannot be used (unwritable, or corrupt beyond repair)."""


class Spool:
    def __init__(
        self, directory: str | os.PathLike[str], max_bytes: int, segment_bytes: int = 16 << 20
    ) -> None:
        if max_bytes < segment_bytes // 16 or segment_bytes < 1024:
            raise ValueError("max_bytes and segment_bytes are too small to hold anything")
        self.dir = Path(directory)
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.dropped = 0
        self.appended = 0
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SpoolError(f"cannot create spool directory {self.dir}: {e}") from None
        self._cursor_file = self.dir / "cursor"
        self._cursor: Position = self._load_cursor()
        segs = self._segments()
        if not segs:
            segs = [max(self._cursor[0], 1)]
            self._segment_path(segs[0]).touch()
        self._repair(segs[-1])
        self._write_seg = segs[-1]
        self._writer = open(self._segment_path(self._write_seg), "ab")  # noqa: SIM115
        if self._cursor[0] < segs[0]:
            self._cursor = (segs[0], 0)
        self._read_pos: Position = self._cursor

    # ------------------------------------------------------------------ files
    def _segment_path(self, n: int) -> Path:
        return self.dir / f"{n:012d}.seg"

    def _segments(self) -> list[int]:
        return sorted(int(p.stem) for p in self.dir.glob("*.seg"))

    def _load_cursor(self) -> Position:
        try:
            seg, off = self._cursor_file.read_text().split()
            return int(seg), int(off)
        except FileNotFoundError:
            return (0, 0)
        except ValueError:
            raise SpoolError(f"spool cursor {self._cursor_file} is corrupt") from None

    def _repair(self, seg: int) -> None:
        """Cut a torn frame off the end of the last segment."""
        path = self._segment_path(seg)
        data = path.read_bytes()
        off = 0
        while off + _HEADER.size <= len(data):
            n, crc = _HEADER.unpack_from(data, off)
            end = off + _HEADER.size + n
            if end > len(data) or zlib.crc32(data[off + _HEADER.size : end]) != crc:
                break
            off = end
        if off != len(data):
            with open(path, "r+b") as f:
                f.truncate(off)

    # ------------------------------------------------------------------ API
    @property
    def size_bytes(self) -> int:
        """Bytes held on disk (delivered entries of the current segment included)."""
        return sum(self._segment_path(s).stat().st_size for s in self._segments())

    def append(self, payloads: Iterable[bytes], sync: bool = False) -> int:
        """Append entries; return how many were taken (the rest were dropped: full)."""
        taken = 0
        used = self.size_bytes
        for p in payloads:
            frame = _HEADER.pack(len(p), zlib.crc32(p)) + p
            if used + len(frame) > self.max_bytes:
                self.dropped += 1
                continue
            if self._writer.tell() + len(frame) > self.segment_bytes and self._writer.tell():
                self._roll()
            self._writer.write(frame)
            used += len(frame)
            taken += 1
        self._writer.flush()
        if sync:
            os.fsync(self._writer.fileno())
        self.appended += taken
        return taken

    def _roll(self) -> None:
        self._writer.flush()
        os.fsync(self._writer.fileno())
        self._writer.close()
        self._write_seg += 1
        self._writer = open(self._segment_path(self._write_seg), "ab")  # noqa: SIM115

    def read(self, max_entries: int) -> list[tuple[bytes, Position]]:
        """The next entries after what was read (not yet committed), with their positions."""
        out: list[tuple[bytes, Position]] = []
        seg, off = self._read_pos
        while len(out) < max_entries:
            path = self._segment_path(seg)
            if not path.exists():
                break
            with open(path, "rb") as f:
                f.seek(off)
                data = f.read()
            pos = 0
            while len(out) < max_entries and pos + _HEADER.size <= len(data):
                n, crc = _HEADER.unpack_from(data, pos)
                end = pos + _HEADER.size + n
                if end > len(data):
                    break
                payload = data[pos + _HEADER.size : end]
                if zlib.crc32(payload) != crc:
                    raise SpoolError(f"spool segment {path} is corrupt at byte {off + pos}")
                pos = end
                out.append((payload, (seg, off + pos)))
            off += pos
            if len(out) >= max_entries or seg >= self._write_seg:
                break
            seg, off = seg + 1, 0
        self._read_pos = (seg, off)
        return out

    def rewind(self) -> None:
        """Read again from the last commit (after a failed delivery)."""
        self._read_pos = self._cursor

    def commit(self, position: Position) -> None:
        """Everything up to ``position`` was delivered: move the cursor, free segments."""
        tmp = self._cursor_file.with_suffix(".tmp")
        tmp.write_text(f"{position[0]} {position[1]}")
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self._cursor_file)
        self._cursor = position
        for s in self._segments():
            if s < position[0]:
                self._segment_path(s).unlink(missing_ok=True)

    def pending(self) -> int:
        """Bytes appended but not yet committed (the agent's lag, on disk)."""
        total = 0
        for s in self._segments():
            size = self._segment_path(s).stat().st_size
            if s == self._cursor[0]:
                total += size - self._cursor[1]
            elif s > self._cursor[0]:
                total += size
        return total

    def close(self) -> None:
        self._writer.close()


__all__ = ["Position", "Spool", "SpoolError"]
