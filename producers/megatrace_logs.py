"""Read the original MEGATRACE collector's per-rank NCCL call logs, with the Megatron
configuration (its NICs' throughput logs are :mod:`producers.megatrace_links`).

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
  up after a backward; they go on a two-rank communicator per pair of ranks. The
  interleaved schedule (a virtual pipeline) orders its transfers otherwise, and a
  stage's last chunk sends to the first stage: its Sends and Recvs are left out,
  counted (:attr:`MegatraceLogReader.unpaired`), rather than paired by a wrong order;
- without ``groupHash``, collectives' communicators: PyTorch gives every process
  group its own NCCL stream, so a rank's calls on one stream are one communicator's.
  Stream pointers are per process, so which communicator a stream is comes from what
  it carries, over the rank's first :data:`LEARN_CALLS` collectives: with tensor
  parallelism the stream with the most calls is the tensor-parallel group's (it has
  several per micro-batch), with data parallelism the one with the largest call of the
  rest the data-parallel group's; members of those come from Megatron's rank layout.
  Any other stream is a communicator of the ranks whose stream begins with the same
  calls (all of them: the world); a rank's second stream beginning alike, by its first
  call, goes with the others' second. A rank that logs all its collectives on one stream
  falls back to sizes: its most frequent element count is tensor-parallel, the others
  data-parallel. Sequence numbers come from the order of calls;
- with ``groupHash``, a communicator's role comes from the ranks that use it.

The line format itself is :mod:`producers.megatrace_lines`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from producers.megatrace_lines import CallLine, LogFormatError
from producers.megatron_config import MegatronConfig
from schemas.enums import DTYPE_BYTES, CollOp, CommRole
from schemas.layout import Layout, comm_hash, one_f_one_b
from schemas.records import Collective, CommInfo

# --------------------------------------------------------------------------- reader


#: a rank's collective calls read before its streams are told apart (a few iterations of
#: any training program, so that its most frequent communicator shows)
LEARN_CALLS = 512
#: the calls that make a stream's signature (ranks whose streams begin alike share it)
_SIGNATURE_CALLS = 8
_P2P = frozenset((CollOp.SEND, CollOp.RECV))


@dataclass
class _RankState:
    sends: int = 0
    recvs: int = 0
    seq: dict[int, int] = field(default_factory=dict)  # inferred comm -> next seq
    p2p_seq: dict[tuple[int, int], int] = field(default_factory=dict)
    buffered: list[CallLine] = field(default_factory=list)
    #: stream -> its communicator's role, once told apart; {} when one stream has them all
    roles: dict[int, CommRole] | None = None
    #: stream -> how it begins (its communicator's members are the ranks beginning alike)
    signatures: dict[int, tuple[tuple[str, int], ...]] = field(default_factory=dict)
    tp_count: int | None = None  # one stream for all collectives: the TP group's size
    #: stream -> (communicator, its size, the rank's place in it, what was inferred) once
    #: its communicator is known (a log has hundreds of thousands of its calls)
    routes: dict[int, tuple[int, int, int, str]] = field(default_factory=dict)


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
        self._layout = Layout(
            config.world_size, config.tp, config.pp, config.dp, 1, config.gpus_per_node
        )
        self.layout = self._layout.groups()
        self._nodes = [self._layout.node(r) for r in range(config.world_size)]
        self._dtype_bytes = DTYPE_BYTES[config.dtype]
        self.inferred: Counter[str] = Counter()
        #: calls of ranks outside the configured world (left out), per rank
        self.outside: dict[int, int] = {}
        #: point-to-point calls left out, their peers unknown (the interleaved schedule)
        self.unpaired = 0
        self._ranks: dict[int, _RankState] = {}
        self._announced: set[int] = set()
        self._groups: dict[tuple[int, CommRole], tuple[int, tuple[int, ...]]] = {}
        self._orders: dict[tuple[int, bool], list[int]] = {}
        self._group_members: dict[int, set[int]] = {}
        self._pending_groups: dict[int, list[Collective]] = {}
        self._comm_sizes: dict[int, tuple[int, dict[int, int]]] = {}
        self._meta_done = False
        #: calls on streams whose communicator waits for every rank's streams to be known
        self._held: list[CallLine] = []
        #: signature -> (communicator, role, members) once every rank's streams are known
        self._others: dict[tuple[tuple[str, int], ...], tuple[int, CommRole, tuple[int, ...]]]
        self._others = {}
        self._others_settled = False

    # ------------------------------------------------------------------ helpers
    def node(self, rank: int) -> str:
        return self._layout.node(rank)

    def stage(self, rank: int) -> int:
        return self._layout.coords(rank)[0]

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
            node=self._nodes[c.rank],
            rank=c.rank,
            comm_hash=h,
            comm_size=size,
            rank_in_comm=rank_in,
            op=c.op,
            seq=seq,
            count=c.count,
            size_bytes=c.count * self._dtype_bytes,
            dtype=self.cfg.dtype,
            enqueue_ns=c.ts_ns,
            end_ns=c.ts_ns,
            peer=peer,
            stream=c.stream & 0x7FFF_FFFF_FFFF_FFFF,
        )

    # ------------------------------------------------------------------ p2p
    def _p2p_order(self, stage: int, sending: bool) -> list[int]:
        """Directions (+1 down, -1 up) of one step's sends or receives on a stage (walked
        once per stage and direction: every transfer a log has asks)."""
        key = (stage, sending)
        found = self._orders.get(key)
        if found is None:
            found = self._orders[key] = self._walk_p2p_order(stage, sending)
        return found

    def _walk_p2p_order(self, stage: int, sending: bool) -> list[int]:
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
        if self.cfg.vpp > 1:
            self.unpaired += 1
            return []
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
    def _group(self, rank: int, role: CommRole) -> tuple[int, tuple[int, ...]]:
        """The communicator of ``role`` that ``rank`` is in, by the layout: (its hash, its
        members); looked up once per rank and role (a log has hundreds of thousands of
        its calls)."""
        key = (rank, role)
        found = self._groups.get(key)
        if found is None:
            if role == CommRole.WORLD:
                members = tuple(range(self.cfg.world_size))
            else:
                members = next(m for m, r in self.layout.items() if r == role and rank in m)
            h = comm_hash(f"inferred-{role.value}", members)
            found = self._groups[key] = (h, members)
        return found

    def _inferred_collective(self, c: CallLine, st: _RankState) -> list[msgspec.Struct]:
        known = st.routes.get(c.stream)
        if known is not None:
            h, size, rank_in, why = known
            self.inferred[why] += 1
            seq = st.seq.get(h, 0)
            st.seq[h] = seq + 1
            return [self._record(c, h, size, rank_in, seq)]
        cfg = self.cfg
        role = st.roles.get(c.stream) if st.roles else None
        by_stream = role is not None
        if role is CommRole.OTHER:
            if not self._others_settled:
                self._held.append(c)
                return []
            h, role, members = self._others[st.signatures[c.stream]]
            why = f"{role.value} communicator from the ranks whose streams begin alike"
        else:
            if role is None and cfg.tp > 1 and cfg.dp > 1:
                role = CommRole.TP if c.count == st.tp_count else CommRole.DP
            elif role is None:
                role = CommRole.TP if cfg.tp > 1 else CommRole.DP if cfg.dp > 1 else CommRole.WORLD
            h, members = self._group(c.rank, role)
            how = "its stream" if st.roles else "the rank layout and call sizes"
            why = f"{role.value} communicator from {how}"
        self.inferred[why] += 1
        if by_stream:
            st.routes[c.stream] = (h, len(members), members.index(c.rank), why)
        seq = st.seq.get(h, 0)
        st.seq[h] = seq + 1
        rec = self._record(c, h, len(members), members.index(c.rank), seq)
        if h in self._announced:
            return [rec]
        return [*self._comm(h, members, role, c.ts_ns, inferred=True), rec]

    def _tell_streams(self, st: _RankState) -> None:
        """Which communicator each of a rank's streams is, from what its buffered calls
        carry (see the module docstring)."""
        streams: dict[int, list[CallLine]] = {}
        for b in st.buffered:
            streams.setdefault(b.stream, []).append(b)
        if len(streams) == 1:
            st.roles = {}
            st.tp_count = Counter(b.count for b in st.buffered).most_common(1)[0][0]
            return
        rest = sorted(streams, key=lambda s: len(streams[s]), reverse=True)
        roles: dict[int, CommRole] = {}
        if self.cfg.tp > 1:
            roles[rest.pop(0)] = CommRole.TP
        if self.cfg.dp > 1 and rest:
            dp = max(rest, key=lambda s: max(b.count for b in streams[s]))
            roles[dp] = CommRole.DP
            rest.remove(dp)
        seen: Counter[tuple[tuple[str, int], ...]] = Counter()
        for s in sorted(rest, key=lambda s: streams[s][0].ts_ns):
            roles[s] = CommRole.OTHER
            begins = tuple((b.op.value, b.count) for b in streams[s][:_SIGNATURE_CALLS])
            # a rank's second stream that begins alike is another communicator's
            st.signatures[s] = (*begins, ("#", seen[begins]))
            seen[begins] += 1
        st.roles = roles

    def _settle_others(self) -> list[msgspec.Struct]:
        """Once every rank's streams are known: the other streams' communicators (the ranks
        whose streams begin alike), and the calls held for them, in order."""
        self._others_settled = True
        by_sig: dict[tuple[tuple[str, int], ...], set[int]] = {}
        for rank, st in self._ranks.items():
            for sig in st.signatures.values():
                by_sig.setdefault(sig, set()).add(rank)
        for sig, ranks in by_sig.items():
            members = tuple(sorted(ranks))
            role = CommRole.WORLD if len(members) == self.cfg.world_size else CommRole.OTHER
            h = comm_hash(f"inferred-{role.value}-{sig!r}", members)
            self._others[sig] = (h, role, members)
        out: list[msgspec.Struct] = []
        held, self._held = self._held, []
        for c in held:
            out += self._inferred_collective(c, self._ranks[c.rank])
        return out

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
            if not self._meta_done:
                out += self._meta(c.ts_ns)
            st = self._ranks.get(c.rank) or self._ranks.setdefault(c.rank, _RankState())
            if c.op in _P2P:
                out += self._p2p(c, st)
            elif c.group_hash is not None and c.op_count is not None:
                out += self._hashed_collective(c)
            elif st.roles is None and (self.cfg.tp > 1 or self.cfg.dp > 1):
                st.buffered.append(c)  # learn which stream is which communicator first
                if len(st.buffered) >= LEARN_CALLS:
                    out += self._release(st)
            else:
                out += self._inferred_collective(c, st)
        return out

    def _release(self, st: _RankState) -> list[msgspec.Struct]:
        self._tell_streams(st)
        out: list[msgspec.Struct] = []
        for b in st.buffered:
            out += self._inferred_collective(b, st)
        st.buffered = []
        if (
            not self._others_settled
            and len(self._ranks) == self.cfg.world_size
            and all(r.roles is not None for r in self._ranks.values())
        ):
            out += self._settle_others()
        return out

    def finish(self) -> list[msgspec.Struct]:
        """Whatever was held back (short logs, groups never seen whole)."""
        out: list[msgspec.Struct] = []
        for st in self._ranks.values():
            if st.buffered:
                out += self._release(st)
        if not self._others_settled:
            out += self._settle_others()
        for h in list(self._pending_groups):
            out += self._settle(h, 0, final=True)
        return out


__all__ = ["MegatraceLogReader"]
