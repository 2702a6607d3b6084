"""What the NCCL Inspector's records say, as read (see :mod:`producers.nccl_inspector`):
each operation and proxy operation of a process on a communicator, before the process's
global rank is known, and the communicator's hash from the Inspector's id.

>>> hex(comm_hash("0x7f01"))
'0x7f01'
>>> proxy_op(("gpu-3", 9), "0x7f01", {"peer": 1, "n_steps": 4}, 2_000).steps
4
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from schemas.enums import CollOp

#: NCCL's operation names, lower-cased
OPS = {op.value.lower(): op for op in CollOp}
US = 1_000  # ns in a microsecond, the Inspector's unit


@dataclass
class Context:
    header: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    remaining: dict[str, int] = field(default_factory=dict)


@dataclass
class Op:
    """One operation as read, before the process's global rank is known."""

    process: tuple[str, int]
    comm: str
    comm_rank: int
    n_ranks: int
    op: CollOp
    sn: int
    size_bytes: int
    exec_ns: int
    dump_ns: int
    start_ns: int | None  # the call (event trace)
    kernel_start_ns: int | None
    kernel_stop_ns: int | None
    peer: int | None  # the peer's rank in the communicator (a transfer)
    algo: str | None
    proto: str | None


@dataclass
class ProxyOp:
    process: tuple[str, int]
    comm: str
    parent_sn: int
    channel: int
    peer: int  # communicator rank
    send: bool
    steps: int
    done: int
    size_bytes: int
    first_ns: int
    last_ns: int
    waits: dict[str, int]


def proxy_op(process: tuple[str, int], comm: str, body: dict[str, Any], dump_ns: int) -> ProxyOp:
    ts = body.get("event_trace_ts") or {}
    first = int(ts.get("proxy_op_start_ts") or 0) * US or dump_ns
    last = int(ts.get("proxy_op_stop_ts") or 0) * US or first
    steps = int(body.get("n_steps", 0))
    return ProxyOp(
        process=process,
        comm=comm,
        parent_sn=int(body.get("parent_sn", 0)),
        channel=int(body.get("channel_id", 0)),
        peer=int(body["peer"]),
        send=str(body.get("direction", "send")) == "send",
        steps=steps,
        done=int(body.get("n_steps_completed", steps)),
        size_bytes=int(body.get("trans_size_bytes", 0)),
        first_ns=first,
        last_ns=last,
        waits={},
    )


def comm_hash(comm_id: str) -> int:
    """A communicator's hash from the Inspector's id (hex, as NCCL's commHash)."""
    try:
        return int(comm_id, 16) & (2**64 - 1)
    except ValueError:
        import hashlib

        return int.from_bytes(hashlib.sha1(comm_id.encode()).digest()[:8], "little")


__all__ = ["OPS", "US", "Context", "Op", "ProxyOp", "comm_hash", "proxy_op"]
