"""The spool's on-disk format (see :mod:`producers.spool`): segments that start with
:data:`SEGMENT_MAGIC` and their first sequence number, then frames, each a sync marker,
the entry's sequence number, the payload's length and a CRC-32 over all three and the
payload, then the payload; and the first format's frames (length, CRC-32, payload).

>>> f = frame(7, b"{}")
>>> frame_at(b"junk" + f, 4)[1:]
(7, b'{}')
>>> next_intact(b"junk" + f, 0)
4
"""

from __future__ import annotations

import struct
import zlib

#: The first bytes of a segment in the current format (then its first sequence number).
SEGMENT_MAGIC = b"MTSPOOL\x02"
SEGMENT_HEAD = struct.Struct("<8sQ")
#: Each frame starts with this marker, so that reading can find the next frame after
#: a damaged one (0xfe and 0x00 do not occur in UTF-8 JSON).
FRAME_MARK = b"\xfe\x00MT"
FRAME_HEAD = struct.Struct("<4sQII")  # marker, sequence number, payload length, crc32
_SEQ_LEN = struct.Struct("<QI")
LEGACY_HEAD = struct.Struct("<II")  # the first format: payload length, crc32 of the payload


def frame(seq: int, payload: bytes) -> bytes:
    """Entry ``seq`` as it is written."""
    n = len(payload)
    crc = zlib.crc32(payload, zlib.crc32(_SEQ_LEN.pack(seq, n)))
    return FRAME_HEAD.pack(FRAME_MARK, seq, n, crc) + payload


def frame_at(data: bytes, off: int) -> tuple[int, int, bytes] | None:
    """The intact frame at ``off``: (its end, its sequence number, payload), or None."""
    if off + FRAME_HEAD.size > len(data) or data[off : off + 4] != FRAME_MARK:
        return None
    _, seq, n, crc = FRAME_HEAD.unpack_from(data, off)
    end = off + FRAME_HEAD.size + n
    if end > len(data):
        return None
    payload = data[off + FRAME_HEAD.size : end]
    if zlib.crc32(payload, zlib.crc32(_SEQ_LEN.pack(seq, n))) != crc:
        return None
    return end, seq, payload


def next_intact(data: bytes, off: int) -> int:
    """Where the next intact frame after ``off`` starts (the end of the data if none)."""
    at = data.find(FRAME_MARK, off + 1)
    while at >= 0 and frame_at(data, at) is None:
        at = data.find(FRAME_MARK, at + 1)
    return at if at >= 0 else len(data)


__all__ = [
    "FRAME_HEAD",
    "FRAME_MARK",
    "LEGACY_HEAD",
    "SEGMENT_HEAD",
    "SEGMENT_MAGIC",
    "frame",
    "frame_at",
    "next_intact",
]
