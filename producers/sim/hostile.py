"""Hostile but fair input: what a broken producer, a corrupt disk or a careless user
sends megatrace, for the fuzz tests and ``megatrace bench faults``.

:func:`hostile_lines` mutates valid records (a field's type swapped, a value out of
every range, nesting past any depth, a tag of megatrace's own output, the bytes cut or
flipped, odd encodings) and mixes in random bytes. Deterministic for a seed.

>>> import random
>>> lines = hostile_lines(random.Random(0), 5)
>>> len(lines), all(isinstance(x, bytes) for x in lines)
(5, True)
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

_GOOD: list[dict[str, Any]] = [
    {"type": "hb", "job": "j", "node": "n0", "rank": 3, "ts_ns": 1_790_000_000_000_000_000,
     "comms": [{"comm_hash": 7, "issued_seq": 4, "completed_seq": 3}]},
    {"type": "coll", "job": "j", "node": "n0", "rank": 1, "comm_hash": 9, "comm_size": 2,
     "rank_in_comm": 1, "op": "AllReduce", "seq": 12, "count": 1024, "size_bytes": 2048,
     "dtype": "bfloat16", "enqueue_ns": 1_790_000_000_000_000_000},
    {"type": "proxy", "job": "j", "node": "n0", "rank": 0, "comm_hash": 9, "seq": 1,
     "channel": 0, "peer": 1, "direction": "send", "steps_posted": 8, "steps_done": 8,
     "size_bytes": 4096, "first_ns": 10, "last_ns": 20},
    {"type": "link", "job": "j", "node": "n0", "rank": 0, "ts_ns": 5, "window_ns": 1,
     "nic": "mlx5_0", "src_rank": 0, "dst_rank": 1, "throughput_gbps": 180.5},
    {"type": "job", "job": "j", "ts_ns": 1, "world_size": 8, "tp": 2, "pp": 2, "dp": 2},
    {"type": "comm", "job": "j", "ts_ns": 1, "comm_hash": 9, "role": "tp", "ranks": [0, 1]},
]  # fmt: skip
_ODD_VALUES: list[Any] = [
    None, True, -1, 0, 2**63, 2**64, -(2**70), 1e308, -0.0, "", "x" * 10_000, "\u0000",
    "\ud800", [], [1, [2, [3]]], {}, {"type": "hb"}, "NaN", 4294967296000000000,
]  # fmt: skip
_TAGS = ["verdict", "label", "dead", "step", "rank_step", "aligned", "align_stats", "nope", ""]


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def _mutate(rng: random.Random, rec: dict[str, Any]) -> bytes:
    rec = dict(rec)
    choice = rng.randrange(9)
    if choice == 0:  # a field's value of another type, or out of range
        rec[rng.choice(list(rec))] = rng.choice(_ODD_VALUES)
    elif choice == 1:  # a field missing
        rec.pop(rng.choice(list(rec)))
    elif choice == 2:  # a tag megatrace writes itself, or none it knows
        rec["type"] = rng.choice([*_TAGS, [1], {"a": 1}, 3])
    elif choice == 3:  # nesting past any depth, where a value or an unknown field goes
        key = rng.choice([*rec, "extra"])
        return (
            json.dumps(rec)[:-1].encode()
            + f', "{key}": {_deep(rng.choice([50, 5000, 20000]))}}}'.encode()
        )
    elif choice == 4:  # a schema version it does not know, or of the wrong type
        rec["v"] = rng.choice([0, 2, 99, "1", [1], 1.5])
    elif choice == 5:  # cut short
        raw = json.dumps(rec).encode()
        return raw[: rng.randrange(len(raw))]
    elif choice == 6:  # a byte flipped
        raw = bytearray(json.dumps(rec).encode())
        raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        return bytes(raw)
    elif choice == 7:  # another encoding
        return json.dumps(rec).encode(rng.choice(["utf-16", "utf-32", "latin-1"]))
    else:  # inconsistent fields
        rec.update({"rank_in_comm": 5, "comm_size": 2, "steps_done": 9, "steps_posted": 1})
    try:
        return json.dumps(rec).encode()
    except (UnicodeEncodeError, ValueError):
        return repr(rec).encode(errors="replace")


Generator = Callable[[random.Random], bytes]


def hostile_lines(rng: random.Random, n: int) -> list[bytes]:
    """``n`` hostile input lines (each one record's bytes; none contains a newline)."""
    out = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.85:
            raw = _mutate(rng, rng.choice(_GOOD))
        elif kind < 0.95:
            raw = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
        else:
            raw = _deep(rng.choice([10, 1000, 100_000])).encode()
        out.append(raw.replace(b"\n", b" "))
    return out


def good_lines() -> list[bytes]:
    """One valid line of each kind the generator mutates."""
    return [json.dumps(r).encode() for r in _GOOD]


__all__ = ["good_lines", "hostile_lines"]
