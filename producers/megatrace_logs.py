"""Read the original MEGATRACE collector's logs: per-rank NCCL call logs, the per-NIC
throughput CSV, and the Megatron configuration.

Call logs have one line per NCCL call, as the original tool writes them::

    [save_count 3] [1718000000.123456789] [Rank 5] Fun AllReduce Data 4096 stream 0x7f3c \
    opCount 12 groupHash -4242

(one line in the file).
``[save_count N]`` is optional; the older variant has no ``opCount``/``groupHash``.
Lines carry the host's call time only, so a call's record ends where it
arrives: the wait model then works on arrivals alone (transfer times read 0).

What the logs do not say is inferred, and every inference is reported
(:attr:`MegatraceLogReader.inferred`):

- point-to-point peers (the logs have none): from Megatron's 1F1B order on the
  rank's pipeline stage, the n-th Send of a step goes down after a forward and
  up after a backward; they go on a two-rank communicator per pair of ranks;
- without ``groupHash``, collectives' communicators: calls with the rank's
  recurring element count are tensor-parallel (several per micro-batch), the
  others data-parallel; members come from Megatron's rank layout, and
  sequence numbers from the order of calls (stream pointers are per process,
  so they only separate a rank's own streams);
- with ``groupHash``, a communicator's role comes from the ranks that use it.

>>> line = "[save_count 2] [1718000000.000000500] [Rank 3] Fun Send Data 1024 stream 0x1a"
>>> c = parse_line(line)
>>> c.ts_ns, c.rank, c.op.value, c.count, c.stream, c.group_hash
(1718000000000000500, 3, 'Send', 1024, 26, None)
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from detectors.topology import one_f_one_b
from producers.megatron_config import ConfigFormatError, MegatronConfig
from producers.torch_collector import comm_hash, megatron_groups
from schemas.records import Collective, CommInfo
from schemas.units import DTYPE_BYTES, CollOp, CommRole


class LogFormatError(ConfigFormatError):
    """A line or file that is not in the MEGATRACE format (with the file and line)."""


_LINE = re.compile(
    r"^(?:\[save_count \d+\]\s+)?\[(?P<sec>\d+)\.(?P<frac>\d+)\]\s+\[Rank (?P<rank>\d+)\]\s+"
    r"Fun (?P<fun>\w+)\s+Data (?P<data>\d+)\s+stream (?P<stream>\S+)"
    r"(?:\s+opCount (?P<opc>\S+))?(?:\s+groupHash (?P<gh>-?\d+))?\s*$"
)
_FUNCS = {op.value: op for op in CollOp}


@dataclass(frozen=True)
class CallLine:
    ts_ns: int
    rank: int
    op: CollOp
    count: int
    stream: int
    op_count: int | None
    group_hash: int | None


def parse_line(line: str) -> CallLine:
    m = _LINE.match(line.strip())
    if m is None:
        raise LogFormatError(f"not a MEGATRACE call line: {line.strip()[:120]!r}")
    fun = m["fun"]
    if fun not in _FUNCS:
        raise LogFormatError(f"unknown NCCL function {fun!r} (known: {', '.join(_FUNCS)})")
    frac = (m["frac"] + "000000000")[:9]
    stream = m["stream"]
    gh = m["gh"]
    return CallLine(
        ts_ns=int(m["sec"]) * 1_000_000_000 + int(frac),
        rank=int(m["rank"]),
        op=_FUNCS[fun],
        count=int(m["data"]),
        stream=int(stream, 16) if stream.lower().startswith("0x") else int(stream),
        op_count=int(m["opc"], 0) if m["opc"] is not None else None,
        group_hash=int(gh) & (2**64 - 1) if gh is not None else None,
    )


def format_line(
    c: Collective, *, stream: int, save_count: int | None = None, ids: bool = True
) -> str:
    """A record as the original tool would have logged it (for interop tests).

    ``ids=False`` writes the older variant without opCount/groupHash.
    """
    sec, ns = divmod(c.enqueue_ns, 1_000_000_000)
    head = f"[save_count {save_count}] " if save_count is not None else ""
    line = (
        f"{head}[{sec}.{ns:09d}] [Rank {c.rank}] Fun {c.op.value} Data {c.count} stream {stream:#x}"
    )
    if ids:
        signed = c.comm_hash - 2**64 if c.comm_hash >= 2**63 else c.comm_hash
        line += f" opCount {c.seq} groupHash {signed}"
    return line


# --------------------------------------------------------------------------- reader


@dataclass
class _RankState:
    sends: int = 0
    recvs: int = 0
    seq: dict[int, int] = field(default_factory=dict)  # inferred comm -> next seq
    p2p_seq: dict[tuple[int, int], int] = field(default_factory=dict)
    buffered: list[CallLine] = field(default_factory=list)
    tp_count: int | None = None


class MegatraceLogReader:
    """Turns call lines (any ranks, in each rank's order) into schema records.

    Feed lines with :meth:`feed`, then call :meth:`finish`. A ``groupHash``'s
    role is settled from every rank that used it, at :meth:`finish`; with
    ``eager=True`` (tailing growing files) as soon as its ranks so far form a
    group of the layout, which can mistake a larger group for a smaller one
    until the other ranks' lines arrive.
    """

    def __init__(self, config: MegatronConfig, job: str, *, eager: bool = False) -> None:
        self.cfg = config
        self.job = job
        self.eager = eager
        self.layout = megatron_groups(config.world_size, config.tp, config.pp, config.dp)
        self.inferred: Counter[str] = Counter()
        #: calls of ranks outside the configured world (left out), per rank
        self.outside: dict[int, int] = {}
        self._ranks: dict[int, _RankState] = {}
        self._announced: set[int] = set()
        self._group_members: dict[int, set[int]] = {}
        self._pending_groups: dict[int, list[Collective]] = {}
        self._comm_sizes: dict[int, tuple[int, dict[int, int]]] = {}
        self._meta_done = False
        per_node = 2 * (config.num_layers // config.pp) * (2 if config.sequence_parallel else 1)
        self._tp_per_node = max(per_node, 1)

    # ------------------------------------------------------------------ helpers
    def node(self, rank: int) -> str:
        return f"node-{rank // self.cfg.gpus_per_node}"

    def stage(self, rank: int) -> int:
        return rank // (self.cfg.tp * self.cfg.dp)

    def _meta(self, ts: int) -> list[msgspec.Struct]:
        if self._meta_done:
            return []
        self._meta_done = True
        out: list[msgspec.Struct] = [self.cfg.job_record(self.job, ts, "megatrace-logs")]
        out += [
            self.cfg.rank_record(self.job, ts, r, self.node(r)) for r in range(self.cfg.world_size)
        ]
        return out

    def _comm(self, h: int, ranks: tuple[int, ...], role: CommRole, ts: int, inferred: bool):
        if h in self._announced:
            return []
        self._announced.add(h)
        return [
            CommInfo(
                job=self.job,
                ts_ns=ts,
                comm_hash=h,
                role=role,
                ranks=list(ranks),
                name=f"{role.value}:{','.join(map(str, ranks))}",
                pp_stage=min(self.stage(r) for r in ranks),
                inferred=inferred,
            )
        ]

    def _record(self, c: CallLine, h: int, size: int, rank_in: int, seq: int, peer=None):
        return Collective(
            job=self.job,
            node=self.node(c.rank),
            rank=c.rank,
            comm_hash=h,
            comm_size=size,
            rank_in_comm=rank_in,
            op=c.op,
            seq=seq,
            count=c.count,
            size_bytes=c.count * DTYPE_BYTES[self.cfg.dtype],
            dtype=self.cfg.dtype,
            enqueue_ns=c.ts_ns,
            end_ns=c.ts_ns,
            peer=peer,
            stream=c.stream & 0x7FFF_FFFF_FFFF_FFFF,
        )

    # ------------------------------------------------------------------ p2p
    def _p2p_order(self, stage: int, sending: bool) -> list[int]:
        """Directions (+1 down, -1 up) of one step's sends or receives on a stage."""
        last = self.cfg.pp - 1
        out = []
        for phase, _ in one_f_one_b(stage, self.cfg.pp, self.cfg.num_microbatches):
            fwd = phase == "forward"
            if sending:
                if fwd and stage < last:
                    out.append(+1)
                elif not fwd and stage > 0:
                    out.append(-1)
            elif fwd and stage > 0:
                out.append(-1)
            elif not fwd and stage < last:
                out.append(+1)
        return out

    def _p2p(self, c: CallLine, st: _RankState) -> list[msgspec.Struct]:
        sending = c.op == CollOp.SEND
        stage = self.stage(c.rank)
        order = self._p2p_order(stage, sending)
        if not order:
            raise LogFormatError(f"rank {c.rank} logs a {c.op.value} but its stage has no peer")
        k = st.sends if sending else st.recvs
        if sending:
            st.sends += 1
        else:
            st.recvs += 1
        peer = c.rank + order[k % len(order)] * self.cfg.tp * self.cfg.dp
        self.inferred["point-to-point peer from the 1F1B order"] += 1
        pair = (min(c.rank, peer), max(c.rank, peer))
        h = comm_hash("p2p", pair)
        sender = c.rank if sending else peer
        seq = st.p2p_seq.get((h, sender), 0)
        st.p2p_seq[(h, sender)] = seq + 1
        out = self._comm(h, pair, CommRole.PP, c.ts_ns, inferred=True)
        return [*out, self._record(c, h, 2, pair.index(c.rank), seq, peer)]

    # ------------------------------------------------------------------ collectives
    def _members(self, rank: int, role: CommRole) -> tuple[int, ...]:
        return next(m for m, r in self.layout.items() if r == role and rank in m)

    def _inferred_collective(self, c: CallLine, st: _RankState) -> list[msgspec.Struct]:
        cfg = self.cfg
        if cfg.tp > 1 and cfg.dp > 1:
            role = CommRole.TP if c.count == st.tp_count else CommRole.DP
        else:
            role = CommRole.TP if cfg.tp > 1 else CommRole.DP if cfg.dp > 1 else CommRole.WORLD
        members = (
            tuple(range(cfg.world_size)) if role == CommRole.WORLD else self._members(c.rank, role)
        )
        h = comm_hash(f"inferred-{role.value}", members)
        seq = st.seq.get(h, 0)
        st.seq[h] = seq + 1
        self.inferred[f"{role.value} communicator from the rank layout and call sizes"] += 1
        out = self._comm(h, members, role, c.ts_ns, inferred=True)
        return [*out, self._record(c, h, len(members), members.index(c.rank), seq)]

    def _hashed_collective(self, c: CallLine) -> list[msgspec.Struct]:
        assert c.group_hash is not None and c.op_count is not None
        h = c.group_hash
        self._group_members.setdefault(h, set()).add(c.rank)
        rec = self._record(c, h, 1, 0, c.op_count)
        if h in self._announced:
            info = self._comm_sizes[h]
            return [msgspec.structs.replace(rec, comm_size=info[0], rank_in_comm=info[1][c.rank])]
        self._pending_groups.setdefault(h, []).append(rec)
        return self._settle(h, c.ts_ns) if self.eager else []

    def _settle(self, h: int, ts: int, final: bool = False) -> list[msgspec.Struct]:
        """Once a groupHash's members match a layout group, announce it and release its calls."""
        seen = tuple(sorted(self._group_members[h]))
        role = self.layout.get(seen)
        if role is None and not final:
            return []
        if role is None:
            role = CommRole.OTHER
        self._comm_sizes[h] = (len(seen), {r: i for i, r in enumerate(seen)})
        self.inferred[f"{role.value} role of a groupHash from its ranks"] += 1
        out = self._comm(h, seen, role, ts, inferred=True)
        for rec in self._pending_groups.pop(h, []):
            out.append(
                msgspec.structs.replace(rec, comm_size=len(seen), rank_in_comm=seen.index(rec.rank))
            )
        return out

    # ------------------------------------------------------------------ feeding
    def feed(self, lines: Iterable[CallLine]) -> list[msgspec.Struct]:
        out: list[msgspec.Struct] = []
        for c in lines:
            if c.rank >= self.cfg.world_size:  # another run's log, or the wrong configuration
                self.outside[c.rank] = self.outside.get(c.rank, 0) + 1
                continue
            out += self._meta(c.ts_ns)
            st = self._ranks.setdefault(c.rank, _RankState())
            if c.op.is_p2p:
                out += self._p2p(c, st)
            elif c.group_hash is not None and c.op_count is not None:
                out += self._hashed_collective(c)
            elif st.tp_count is None and self.cfg.tp > 1 and self.cfg.dp > 1:
                st.buffered.append(c)  # learn this rank's recurring (TP) size first
                if len(st.buffered) >= 2 * self._tp_per_node:
                    out += self._release(st)
            else:
                out += self._inferred_collective(c, st)
        return out

    def _release(self, st: _RankState) -> list[msgspec.Struct]:
        counts = Counter(b.count for b in st.buffered)
        st.tp_count = counts.most_common(1)[0][0]
        out: list[msgspec.Struct] = []
        for b in st.buffered:
            out += self._inferred_collective(b, st)
        st.buffered = []
        return out

    def finish(self) -> list[msgspec.Struct]:
        """Whatever was held back (short logs, groups never seen whole)."""
        out: list[msgspec.Struct] = []
        for st in self._ranks.values():
            if st.buffered:
                out += self._release(st)
        for h in list(self._pending_groups):
            out += self._settle(h, 0, final=True)
        return out


__all__ = ["CallLine", "LogFormatError", "MegatraceLogReader", "format_line", "parse_line"]
