"""Read PyTorch Flight Recorder dumps, so a hang's dumps go through ``megatrace analyze``.

A dump is one file per rank, a pickle or JSON (``torch`` writes both), named with any
prefix and the rank at its end. What it holds, across PyTorch 2.4 to 2.13 (dump
versions 2.x):

* ``version``; ``pg_config``: each process group's name, description and member ranks
  (a list, or a string of one; empty where the backend does not say, as Gloo's);
  ``pg_status``: each group's last enqueued, started and completed collective, which
  says how far a rank got even once its ring buffer wrapped (keyed by the group's id
  in that process, which the entries pair with its name);
* ``entries``: the ring buffer of the rank's last calls, each with its group, its
  ``collective_seq_id`` (counted from 1, per group) or ``p2p_seq_id``, its
  ``profiling_name`` (``nccl:all_reduce``, ``nccl:_all_gather_base``, ``gloo:barrier``,
  ``nccl:send 0->1``, ``nccl:coalesced``...: :data:`~schemas.units.TORCH_OP_NAMES`),
  sizes and dtypes, ``state`` (scheduled, started, completed), ``retired`` (the work
  is over), ``time_created_ns`` and the ``time_discovered_*`` times.

Every call becomes a :class:`~schemas.records.Collective` (unfinished ones without an
end); the ops of a coalesced group (one sequence number, closed by a ``coalesced``
entry) are one collective instance, or their transfers; a transfer's peer is in its
name (group ranks), else the other member of a two-rank group. Each rank's progress
per group (from ``pg_status``, else its entries) becomes a
:class:`~schemas.records.Heartbeat` at the time of its dump, so the analysis sees who
never joined the stuck collective. A group's role comes from its description
(Megatron names them: ``TENSOR_MODEL_PARALLEL_GROUP``...) or the Megatron layout when
one is given; its members, where the dump lists none, from the ranks that use it, and
where every one of those waits in a call none of them completed, or one rank alone
calls collectives on it, the ranks that wrote no dump too (a stopped or killed rank
writes none). Reading the files and their
entries is :mod:`producers.fr_dump`'s.

Pickles are read with a restricted unpickler that builds only plain containers and
numbers: a dump file cannot run code. Entries that cannot be read are counted with why
(:attr:`FlightRecorderImport.skipped`), never silently dropped.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec

from producers.fr_dump import (
    DTYPE_BYTES,
    Call,
    DumpFormatError,
    blocked,
    coalesce,
    dump_time_ns,
    pg_of,
    ranks_in,
    read_dump,
    status_by_name,
)
from producers.megatron_config import MegatronConfig
from schemas.enums import CollOp, CommRole
from schemas.layout import Layout, comm_hash
from schemas.records import Collective, CommInfo, CommProgress, Heartbeat

#: a group's role from the description Megatron (and torch) give it
_ROLES = (
    ("TENSOR", CommRole.TP),
    ("PIPELINE", CommRole.PP),
    ("EXPERT", CommRole.EP),
    ("CONTEXT", CommRole.CP),
    ("DATA_PARALLEL", CommRole.DP),
    ("default_pg", CommRole.WORLD),
)


class FlightRecorderImport:
    """Turns every rank's dump into schema records (see the module docstring)."""

    def __init__(self, job: str, config: MegatronConfig | None = None, node_of=None) -> None:
        self.job = job
        self.config = config
        self.node_of = node_of or (lambda rank: f"host-rank{rank}")
        self.skipped: dict[str, int] = {}
        self.inferred: dict[str, int] = {}

    def _skip(self, why: str, n: int = 1) -> None:
        self.skipped[why] = self.skipped.get(why, 0) + n

    def _groups(
        self,
        dumps: dict[int, dict[str, Any]],
        calls: dict[int, list[Call]],
        status: dict[int, dict[str, dict[str, Any]]],
        world: int,
    ) -> dict[str, tuple[tuple[int, ...], str]]:
        """Each group's (members, description): from ``pg_config``, else the ranks whose
        ``pg_status`` (``status``: each rank's, by group name) or calls name it (all ranks
        for the default group)."""
        listed: dict[str, tuple[tuple[int, ...], str]] = {}
        users: dict[str, set[int]] = {}
        descs: dict[str, str] = {}
        for rank, d in dumps.items():
            for name, pg in (d.get("pg_config") or {}).items():
                ranks = ranks_in(pg.get("ranks")) if isinstance(pg, dict) else ()
                desc = str(pg.get("desc", "")) if isinstance(pg, dict) else ""
                if ranks:
                    listed[str(name)] = (ranks, desc)
                descs.setdefault(str(name), desc)
            for name in status[rank]:
                users.setdefault(name, set()).add(rank)
            for e in d["entries"]:
                name, desc = pg_of(e)
                users.setdefault(name, set()).add(rank)
                if desc:
                    descs[name] = desc
        out = dict(listed)
        silent = tuple(r for r in range(world) if r not in dumps)
        for name, ranks in users.items():
            if name in out or not name:
                continue
            desc = descs.get(name, "")
            if desc == "default_pg" or name == "0":
                out[name] = (tuple(range(world)), desc or "default_pg")
                continue
            self._infer("a group's members from the ranks that use it")
            if silent and blocked(name, ranks, status, calls):
                # a call every member that dumped posted and none completed waits on a
                # member that wrote no dump (stopped, killed, hung outside the watchdog)
                ranks = ranks | set(silent)
                self._infer("a blocked group's members among the ranks that wrote no dump")
            elif silent and len(ranks) == 1 and _calls_on(name, calls.get(min(ranks), [])):
                # a group that one rank that dumped calls collectives on has other members
                # (a group of one has nobody to wait for): those that wrote none (a killed
                # rank's peers fail in its calls, which their dumps show retired)
                ranks = ranks | set(silent)
                self._infer("a lone caller's group's members among the ranks that wrote no dump")
            out[name] = (tuple(sorted(ranks)), desc)
        return out

    def _infer(self, what: str) -> None:
        self.inferred[what] = self.inferred.get(what, 0) + 1

    def _status(self, d: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """:func:`status_by_name`, what it cannot name counted in :attr:`skipped`."""
        status, unnamed = status_by_name(d)
        if unnamed:
            self._skip("a group's status no entry names", unnamed)
        return status

    def records(self, dumps: dict[int, dict[str, Any]], dump_times: dict[int, int]) -> list:
        read = {}
        for rank, d in dumps.items():
            calls, skipped = coalesce(d["entries"])
            read[rank] = calls
            for why, n in skipped.items():
                self._skip(why, n)
        listed = [
            max(ranks_in(pg.get("ranks")) or (0,)) + 1
            for d in dumps.values()
            for pg in (d.get("pg_config") or {}).values()
            if isinstance(pg, dict)
        ]
        world = max([max(dumps) + 1, *listed])
        cfg = self.config or MegatronConfig(world_size=world)
        if cfg.world_size < world:
            raise DumpFormatError(
                f"dumps name rank {world - 1}, beyond the world of {cfg.world_size}"
            )
        status = {rank: self._status(d) for rank, d in dumps.items()}
        groups = self._groups(dumps, read, status, cfg.world_size)
        shape = Layout(cfg.world_size, cfg.tp, cfg.pp, cfg.dp)
        layout = shape.groups() if self.config else {}
        first_ns = min((c.created for cs in read.values() for c in cs), default=0)
        out: list[msgspec.Struct] = [cfg.job_record(self.job, first_ns, "flight-recorder")]
        hashes: dict[str, int] = {}
        listed_names = {
            str(n)
            for d in dumps.values()
            for n, pg in (d.get("pg_config") or {}).items()
            if isinstance(pg, dict) and ranks_in(pg.get("ranks"))
        }
        for name, (ranks, desc) in sorted(groups.items()):
            # by name: two groups over the same ranks are two communicators
            h = hashes[name] = comm_hash(f"pg:{name}", ranks)
            out.append(
                CommInfo(
                    job=self.job,
                    ts_ns=first_ns,
                    comm_hash=h,
                    role=_role(desc, ranks, layout, cfg.world_size),
                    ranks=list(ranks),
                    name=f"pg {name}" + (f" ({desc})" if desc else ""),
                    pp_stage=min(shape.coords(r)[0] for r in ranks),
                    inferred=name not in listed_names,
                )
            )
        out += [cfg.rank_record(self.job, first_ns, r, self.node_of(r)) for r in sorted(dumps)]
        colls: list[Collective] = []
        for rank in sorted(read):
            colls += self._collectives(rank, read[rank], groups, hashes)
        _align_transfers(colls)
        for rank in sorted(dumps):
            out += self._liveness(rank, status[rank], [c for c in colls if c.rank == rank],
                                  hashes, dump_times[rank])  # fmt: skip
        colls.sort(key=lambda c: c.enqueue_ns)
        hb = sorted((r for r in out if isinstance(r, Heartbeat)), key=lambda h: h.ts_ns)
        meta = [r for r in out if not isinstance(r, Heartbeat)]
        return [*meta, *colls, *hb]

    def _collectives(
        self, rank: int, calls: list[Call], groups: dict, hashes: dict[str, int]
    ) -> list[Collective]:
        out = []
        for c in calls:
            if c.pg not in groups:
                self._skip("a call on a group no dump describes")
                continue
            members, _ = groups[c.pg]
            if rank not in members:
                self._skip("a call on a group the rank is not a member of")
                continue
            peer = None
            if c.p2p:
                if c.peers is not None:
                    src, dst = c.peers
                    local = members.index(rank)
                    other = dst if src == local else src
                    if other >= len(members):
                        self._skip("a transfer to a group rank beyond the group")
                        continue
                    peer = members[other]
                elif len(members) == 2:
                    peer = members[1 - members.index(rank)]
                else:
                    self._skip("a transfer whose peer the dump does not name")
                    continue
            out.append(
                Collective(
                    job=self.job,
                    node=self.node_of(rank),
                    rank=rank,
                    comm_hash=hashes[c.pg],
                    comm_size=len(members),
                    rank_in_comm=members.index(rank),
                    op=c.op,
                    seq=max(c.seq - 1, 0),  # Flight Recorder counts from 1
                    count=c.count,
                    size_bytes=c.count * DTYPE_BYTES.get(c.dtype, 1),
                    dtype=c.dtype,
                    enqueue_ns=c.created,
                    start_ns=c.started,
                    end_ns=c.ended if c.ended is None or c.ended >= c.created else c.created,
                    peer=peer,
                )
            )
        return out

    def _liveness(
        self, rank: int, status: dict[str, dict[str, Any]], colls: list[Collective],
        hashes: dict[str, int], dumped_ns: int,
    ) -> list[Heartbeat]:  # fmt: skip
        """The rank's progress per group as its dump tells it: up to its last completion,
        then none until the dump (the silence that makes a hang)."""
        progress: dict[int, list[int]] = {}
        for c in colls:
            if c.peer is not None:
                continue  # transfers' numbers run per peer: liveness counts collectives
            p = progress.setdefault(c.comm_hash, [-1, -1])
            p[0] = max(p[0], c.seq)
            if c.end_ns is not None:
                p[1] = max(p[1], c.seq)
        for name, st in status.items():
            if name in hashes:  # beyond what the buffer kept
                p = progress.setdefault(hashes[str(name)], [-1, -1])
                p[0] = max(p[0], int(st.get("last_enqueued_collective", 0) or 0) - 1)
                p[1] = max(p[1], int(st.get("last_completed_collective", 0) or 0) - 1)
        comms = [CommProgress(comm_hash=h, issued_seq=i, completed_seq=c)
                 for h, (i, c) in progress.items()]  # fmt: skip
        last_done = max((c.end_ns for c in colls if c.end_ns), default=0)
        return [
            Heartbeat(job=self.job, node=self.node_of(rank), rank=rank, ts_ns=ts, comms=comms)
            for ts in sorted({last_done, dumped_ns} - {0})
        ]


def _role(
    desc: str, ranks: tuple[int, ...], layout: dict[tuple[int, ...], CommRole], world: int
) -> CommRole:
    for word, role in _ROLES:
        if word in desc.upper() or word in desc:
            return role
    if ranks in layout:
        return layout[ranks]
    return CommRole.WORLD if len(ranks) == world and world > 1 else CommRole.OTHER


def _align_transfers(colls: list[Collective]) -> None:
    """Number each pair's transfers the same on both ends: the n-th send from s to d meets
    the n-th receive at d from s. Buffers that wrapped at different points start their
    counts at different transfers, so each receiving side is shifted to the send it is
    nearest in time (a receive is posted about when its send is)."""
    sends: dict[tuple[int, int, int], list[int]] = {}
    recvs: dict[tuple[int, int, int], list[int]] = {}
    for i, c in enumerate(colls):
        if c.peer is None:
            continue
        if c.op is CollOp.SEND:
            sends.setdefault((c.comm_hash, c.rank, c.peer), []).append(i)
        else:
            recvs.setdefault((c.comm_hash, c.peer, c.rank), []).append(i)
    for key in set(sends) | set(recvs):
        s = sorted(sends.get(key, []), key=lambda i: colls[i].enqueue_ns)
        r = sorted(recvs.get(key, []), key=lambda i: colls[i].enqueue_ns)
        shift = _best_shift([colls[i].enqueue_ns for i in s], [colls[i].enqueue_ns for i in r])
        for n, i in enumerate(s):
            colls[i] = msgspec.structs.replace(colls[i], seq=n)
        for n, i in enumerate(r):
            colls[i] = msgspec.structs.replace(colls[i], seq=max(0, n + shift))


def _best_shift(sends: list[int], recvs: list[int], most: int = 64) -> int:
    """The offset ``k`` that pairs receive ``n`` with send ``n + k`` best in time."""
    if not sends or not recvs:
        return 0
    best, best_cost = 0, float("inf")
    for k in range(-min(most, len(recvs) - 1), min(most, len(sends) - 1) + 1):
        pairs = [(sends[n + k], recvs[n]) for n in range(len(recvs)) if 0 <= n + k < len(sends)]
        if not pairs:
            continue
        cost = sorted(abs(a - b) for a, b in pairs)[len(pairs) // 2]
        if cost < best_cost:
            best, best_cost = k, cost
    return best


def import_dumps(
    paths: Iterable[Path], job: str, config: MegatronConfig | None = None
) -> tuple[list[msgspec.Struct], dict[str, int]]:
    """Every record of a hang's dumps (one file per rank); and what was skipped."""
    dumps: dict[int, dict[str, Any]] = {}
    times: dict[int, int] = {}
    for p in paths:
        rank, d = read_dump(p)
        dumps[rank] = d
        times[rank] = dump_time_ns(p, d)
    if not dumps:
        raise DumpFormatError("no Flight Recorder dumps given")
    imp = FlightRecorderImport(job, config)
    return imp.records(dumps, times), imp.skipped


def _calls_on(name: str, calls: list[Call]) -> bool:
    """Whether ``calls`` hold a collective on group ``name``."""
    return any(c.pg == name and not c.p2p for c in calls)


__all__ = ["DumpFormatError", "FlightRecorderImport", "dump_time_ns", "import_dumps", "read_dump"]
