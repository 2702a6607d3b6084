"""A bounded on-disk queue: what the node agent accepted and has not yet delivered.

Entries are appended to segment files as frames and read back in order from a
cursor that only moves when the caller says the entries were delivered
(:meth:`Spool.commit`). The cursor is written atomically (write, fsync, rename)
and fully delivered segments are deleted, so an agent that crashes, or a broker
that is down for an hour, loses nothing that was appended, and delivery resumes in
order; an entry may be delivered twice (after a crash between delivery and
commit), which the idempotent sinks absorb.

A frame is a sync marker, the entry's sequence number, the payload's length and a
CRC-32 over all three and the payload, then the payload. Damage on disk (a flipped
bit, a lost sector, a truncated or deleted segment) is never fatal: a damaged frame
is skipped, reading goes on at the next intact frame (found by its marker), and the
entries lost are counted exactly from the gap in sequence numbers
(:attr:`Spool.lost`, and ``on_loss`` with what was damaged and how many entries it
cost). A damaged or torn end of the newest segment (a record being written when the
process died) is cut off at open, and counted too. Segments
of the agent's first format (no markers, no sequence numbers) are still read.

``max_bytes`` bounds what is accepted and not yet delivered: when appending
would exceed it the entry is refused and counted (:attr:`Spool.dropped`), and
the caller says so loudly. Segments are sized from the bound, so delivered
entries give their room back soon after (the disk holds at most ``max_bytes``
and about one segment). One process uses a spool directory at a time: a second one
gets :class:`SpoolError` naming the first one's pid. Appends are flushed to the
operating system, not synced (``sync=True`` does): a process that dies loses
nothing appended, a machine that loses power may lose the last appends.

>>> import tempfile
>>> sp = Spool(tempfile.mkdtemp(), max_bytes=1 << 20)
>>> sp.append([b"a", b"bb", b"ccc"])
3
>>> batch = sp.read(2)
>>> [p for p, _ in batch]
[b'a', b'bb']
>>> sp.commit(batch[-1][1]); [p for p, _ in sp.read(10)]
[b'ccc']
>>> sp.pending()  # bytes accepted and not delivered: one 20-byte header and 3 bytes
23
>>> sp.close()
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from producers.spool_frames import (
    FRAME_HEAD,
    FRAME_MARK,
    LEGACY_HEAD,
    SEGMENT_HEAD,
    SEGMENT_MAGIC,
    frame,
    frame_at,
    next_intact,
)

#: (segment number, byte offset after the entry, sequence number of the next entry or -1)
Position = tuple[int, int, int]


class SpoolError(RuntimeError):
    """The spool directory cannot be used (unwritable, or in use by another agent)."""


class Spool:
    def __init__(
        self,
        directory: str | os.PathLike[str],
        max_bytes: int,
        segment_bytes: int | None = None,
        on_loss: Callable[[str, int], None] | None = None,
    ) -> None:
        if max_bytes < 4096:
            raise ValueError(f"a spool needs at least 4 KiB (max_bytes {max_bytes})")
        if segment_bytes is None:  # delivered entries give their room back soon after
            segment_bytes = min(16 << 20, max(64 << 10, max_bytes // 8))
        if segment_bytes < 1024:
            raise ValueError(f"segment_bytes {segment_bytes} is too small to hold anything")
        self.dir = Path(directory)
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.on_loss = on_loss
        self.dropped = 0  # refused: the spool was full
        self.lost = 0  # accepted, then unreadable (damaged on disk)
        self.appended = 0
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SpoolError(f"cannot create spool directory {self.dir}: {e}") from None
        self._lock = self._take_lock()
        self._cursor_file = self.dir / "cursor"
        self._cursor: Position = self._load_cursor()
        segs = self._segments()
        self._sizes: dict[int, int] = {}
        self._heads: dict[int, int] = {}  # current-format segments: their header's size
        self._writer: Any = None
        if not segs:
            self._write_seg = max(self._cursor[0], 1) - 1
            self._next_seq = max(self._cursor[2], 0)
            self._roll()
            segs = [self._write_seg]
            # where reading begins, kept from the start: a segment lost before the first
            # delivery is then counted too
            self.commit((self._write_seg, 0, self._next_seq))
        else:
            self._sizes = {s: self._segment_path(s).stat().st_size for s in segs}
            self._heads = {s: SEGMENT_HEAD.size for s in segs if self._is_current(s)}
            self._write_seg = segs[-1]
            self._next_seq = self._repair(segs[-1])
            if self._write_seg in self._heads:
                self._writer = open(self._segment_path(self._write_seg), "ab")  # noqa: SIM115
            else:  # never append to a first-format segment
                self._roll()
        if self._cursor[0] < segs[0]:
            self._cursor = (segs[0], 0, self._cursor[2])
        self._read_pos: Position = self._cursor
        self._pending = self._bytes_after(self._cursor)

    # ------------------------------------------------------------------ files
    def _take_lock(self) -> int:
        path = self.dir / "lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise SpoolError(
                f"spool directory {self.dir} is in use by another agent (pid {holder}): "
                f"one agent per spool directory (give each its own --spool-dir)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        return fd

    def _segment_path(self, n: int) -> Path:
        return self.dir / f"{n:012d}.seg"

    def _segments(self) -> list[int]:
        return sorted(int(p.stem) for p in self.dir.glob("*.seg") if p.stem.isdigit())

    def _is_current(self, seg: int) -> bool:
        """Current format: its header, or a damaged header before a frame marker (a
        first-format segment starts with a payload's length and JSON)."""
        with open(self._segment_path(seg), "rb") as f:
            head = f.read(SEGMENT_HEAD.size + len(FRAME_MARK))
        if head.startswith(SEGMENT_MAGIC) or len(head) < LEGACY_HEAD.size:
            return True
        return head[SEGMENT_HEAD.size :] == FRAME_MARK

    def _load_cursor(self) -> Position:
        try:
            parts = [int(x) for x in self._cursor_file.read_text().split()]
        except FileNotFoundError:
            return (0, 0, -1)
        except ValueError:
            # a damaged cursor: read again from the oldest segment (duplicates, not loss)
            return (0, 0, -1)
        if len(parts) == 2:  # written by the first format
            return (parts[0], parts[1], -1)
        if len(parts) != 3:
            return (0, 0, -1)
        return (parts[0], parts[1], parts[2])

    def _first_seq(self, seg: int, data: bytes) -> int:
        if data.startswith(SEGMENT_MAGIC) and len(data) >= SEGMENT_HEAD.size:
            return SEGMENT_HEAD.unpack_from(data)[1]
        found = frame_at(data, next_intact(data, SEGMENT_HEAD.size - 1))
        return found[1] if found else 0

    def _repair(self, seg: int) -> int:
        """Cut the torn frame (a crash mid-write) off the end of the newest segment; damage
        with intact frames after it is left for :meth:`read` to skip and count. Returns
        the sequence number the next entry gets."""
        path = self._segment_path(seg)
        data = path.read_bytes()
        if seg not in self._heads:
            return 0  # a first-format segment: read as it is, and rolled past
        nxt = self._first_seq(seg, data)
        off = SEGMENT_HEAD.size
        while off < len(data):
            found = frame_at(data, off)
            if found is not None:
                off, seq, _ = found
                nxt = max(nxt, seq + 1)
                continue
            after = next_intact(data, off)
            if after < len(data):
                off = after
                continue
            # nothing intact after it: the record being written when the process died (it
            # was received, not kept), or the last records damaged in place: either way
            # records are missing, and counted
            last = max(1, data.count(FRAME_MARK, off))
            self._lose(f"{path} ends in a damaged or torn record at byte {off}", last)
            # the next entry takes the first missing number: reading then sees no gap to
            # count a second time
            with open(path, "r+b") as f:
                f.truncate(off)
            self._sizes[seg] = off
            break
        return nxt

    def _bytes_after(self, pos: Position) -> int:
        """Bytes of entries after ``pos`` (segment headers left out)."""
        seg, off, _ = pos
        total = 0
        for s, size in self._sizes.items():
            if s >= seg:
                head = self._heads.get(s, 0)
                total += max(0, size - max(head, off if s == seg else 0))
        return total

    # ------------------------------------------------------------------ API
    @property
    def size_bytes(self) -> int:
        """Bytes held on disk (delivered entries of segments not yet freed included)."""
        return sum(self._sizes.values())

    def append(self, payloads: Iterable[bytes], sync: bool = False) -> int:
        """Append entries; return how many were taken (the rest were dropped: full)."""
        taken = 0
        for p in payloads:
            size = FRAME_HEAD.size + len(p)
            if self._pending + size > self.max_bytes:
                self.dropped += 1
                continue
            if self._sizes[self._write_seg] + size > self.segment_bytes:
                self._roll()
            self._writer.write(frame(self._next_seq, p))
            self._next_seq += 1
            self._sizes[self._write_seg] += size
            self._pending += size
            taken += 1
        self._writer.flush()
        if sync:
            os.fsync(self._writer.fileno())
        self.appended += taken
        return taken

    def _roll(self) -> None:
        if self._writer is not None:
            self._writer.flush()
            os.fsync(self._writer.fileno())
            self._writer.close()
        self._write_seg += 1
        path = self._segment_path(self._write_seg)
        path.write_bytes(SEGMENT_HEAD.pack(SEGMENT_MAGIC, self._next_seq))
        self._sizes[self._write_seg] = self._heads[self._write_seg] = SEGMENT_HEAD.size
        self._writer = open(path, "ab")  # noqa: SIM115

    def read(self, max_entries: int) -> list[tuple[bytes, Position]]:
        """The next entries after what was read (not yet committed), with their positions.
        Damaged frames are skipped and the entries they cost counted (see the module
        docstring)."""
        out: list[tuple[bytes, Position]] = []
        seg, off, expect = self._read_pos
        while len(out) < max_entries:
            path = self._segment_path(seg)
            try:
                with open(path, "rb") as f:
                    if off >= SEGMENT_HEAD.size:  # read on from where the last read stopped
                        f.seek(off)
                        base = off
                    else:
                        base = 0
                    data = f.read()
            except FileNotFoundError:
                if seg >= self._write_seg:
                    break
                seg, off = seg + 1, 0
                continue
            if seg in self._heads:
                if off < SEGMENT_HEAD.size:
                    first = self._first_seq(seg, data)
                    if expect >= 0 and first > expect:  # a segment lost, or cut short
                        self._lose(f"entries before {path} are missing", first - expect)
                    expect = max(expect, first) if expect >= 0 else first
                    off = SEGMENT_HEAD.size
                rel, expect = self._read_frames(
                    path, data, seg, base, off - base, expect, max_entries, out
                )
                off = base + rel
            else:
                off = base + self._read_legacy(path, data, seg, base, off - base, max_entries, out)
            if len(out) >= max_entries or seg >= self._write_seg:
                break
            seg, off = seg + 1, 0
        self._read_pos = (seg, off, expect)
        return out

    def _read_frames(
        self,
        path: Path,
        data: bytes,
        seg: int,
        base: int,
        off: int,
        expect: int,
        limit: int,
        out: list[tuple[bytes, Position]],
    ) -> tuple[int, int]:
        """Frames of ``data`` (a segment's bytes from ``base``) from offset ``off`` in it;
        returns where it stopped in ``data`` and the next sequence number expected."""
        while len(out) < limit and off < len(data):
            found = frame_at(data, off)
            if found is None:
                if off + FRAME_HEAD.size > len(data) and seg >= self._write_seg:
                    break  # the end of what was written so far
                damaged, off = off, next_intact(data, off)
                if off >= len(data):  # nothing intact after it in this segment
                    cost = max(1, data.count(FRAME_MARK, damaged))
                    self._lose(f"{path} is damaged at byte {base + damaged}", cost)
                    expect = expect + cost if expect >= 0 else expect
                continue
            end, seq, payload = found
            if expect >= 0 and seq < expect:  # already read: a damaged region's echo
                off = end
                continue
            if expect >= 0 and seq > expect:
                self._lose(f"{path} is damaged before byte {base + off}", seq - expect)
            off, expect = end, seq + 1
            out.append((payload, (seg, base + off, expect)))
        return off, expect

    def _read_legacy(
        self,
        path: Path,
        data: bytes,
        seg: int,
        base: int,
        off: int,
        limit: int,
        out: list[tuple[bytes, Position]],
    ) -> int:
        while len(out) < limit and off + LEGACY_HEAD.size <= len(data):
            n, crc = LEGACY_HEAD.unpack_from(data, off)
            end = off + LEGACY_HEAD.size + n
            payload = data[off + LEGACY_HEAD.size : end]
            if end > len(data) or zlib.crc32(payload) != crc:
                # no markers to resync on: the rest of this segment is lost
                self._lose(f"{path} (first format) is damaged at byte {base + off}", 1)
                return len(data)
            off = end
            out.append((payload, (seg, base + off, -1)))
        return off

    def _lose(self, what: str, entries: int) -> None:
        self.lost += entries
        if self.on_loss is not None:
            self.on_loss(what, entries)

    def rewind(self) -> None:
        """Read again from the last commit (after a failed delivery)."""
        self._read_pos = self._cursor

    def commit(self, position: Position) -> None:
        """Everything up to ``position`` was delivered: move the cursor, free segments."""
        tmp = self._cursor_file.with_suffix(".tmp")
        tmp.write_text(" ".join(map(str, position)))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self._cursor_file)
        self._cursor = position
        for s in [s for s in self._sizes if s < position[0]]:
            self._segment_path(s).unlink(missing_ok=True)
            del self._sizes[s]
            self._heads.pop(s, None)
        self._pending = self._bytes_after(position)
        seg = self._write_seg
        if position[0] == seg and position[1] >= self._sizes[seg] > self.segment_bytes // 2:
            self._roll()  # all delivered: a new segment, so this one can go

    def pending(self) -> int:
        """Bytes accepted and not yet delivered (the agent's lag, on disk)."""
        return self._pending

    def close(self) -> None:
        self._writer.close()
        with contextlib.suppress(OSError):
            os.close(self._lock)


__all__ = ["FRAME_MARK", "SEGMENT_MAGIC", "Position", "Spool", "SpoolError", "frame"]
