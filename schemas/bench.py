"""Codec benchmark: why msgspec is the wire codec (decode *and* validate in one pass)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

import msgspec

from schemas.codec import decode, encode
from schemas.enums import CollOp, DType
from schemas.records import Collective


def _sample(n: int) -> list[bytes]:
    return [
        encode(
            Collective(
                job="bench",
                node=f"node-{i % 64}",
                rank=i % 512,
                comm_hash=0xABCDEF0123456789,
                comm_size=8,
                rank_in_comm=i % 8,
                op=CollOp.ALL_REDUCE,
                seq=i,
                count=1 << 20,
                size_bytes=2 << 20,
                dtype=DType.BFLOAT16,
                enqueue_ns=1_700_000_000_000_000_000 + i,
                start_ns=1_700_000_000_000_000_100 + i,
                end_ns=1_700_000_000_000_900_000 + i,
            )
        )
        for i in range(n)
    ]


def _rate(fn: Callable[[bytes], object], data: list[bytes]) -> float:
    t0 = time.perf_counter()
    for raw in data:
        fn(raw)
    return len(data) / (time.perf_counter() - t0)


def codec_table(n: int) -> Iterator[str]:
    """Rows of a table: decoder, records/s, relative to stdlib json (parse only vs validated)."""
    data = _sample(n)
    rows: list[tuple[str, float]] = [
        ("json.loads (parse only)", _rate(json.loads, data)),
    ]
    try:
        import orjson

        rows.append(("orjson.loads (parse only)", _rate(orjson.loads, data)))
        rows.append(
            (
                "orjson + msgspec.convert (validated)",
                _rate(lambda r: msgspec.convert(orjson.loads(r), Collective), data),
            )
        )
    except ImportError:
        pass
    rows.append(("msgspec untyped (parse only)", _rate(msgspec.json.decode, data)))
    rows.append(("megatrace decode (msgspec, validated)", _rate(decode, data)))
    base = rows[0][1]
    yield f"{'decoder':<40} {'records/s':>12} {'vs json':>8}"
    for name, rate in rows:
        yield f"{name:<40} {rate:>12,.0f} {rate / base:>7.2f}x"
