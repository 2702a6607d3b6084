"""Read the NCCL Inspector's JSON output (``plugins/profiler/inspector``, NCCL 2.28+), so a
user who already runs the Inspector gets verdicts without megatrace's own plugin.

The Inspector writes newline-delimited JSON per process. In format v4.3 each
communicator's dump starts with a ``dump_stats`` marker carrying the communicator's
``header`` (its ``id``, this process's ``rank`` in it, ``n_ranks``, ``nnodes``) and the
process's ``metadata`` (``hostname``, ``pid``, ``dump_timestamp_us``); the
``coll_perf``, ``p2p_perf`` and ``proxy_trace`` records that follow belong to it
(their counts are in the marker). Older formats (v4.0 to v4.2) repeat ``header`` and
``metadata`` on every record. :class:`InspectorReader` restores that context per file.

What becomes of it:

* ``coll_perf`` and ``p2p_perf``: a :class:`~schemas.records.Collective` each, named
  by the communicator's id and its sequence number (``coll_sn``, ``p2p_sn``). With
  ``NCCL_INSPECTOR_DUMP_VERBOSE=1`` their times are the event trace's: the call
  (``coll_start_ts``) and its kernels' first start and last stop. Without it only the
  execution time is known: every member of one instance is given the same end (the
  earliest of their dumps) and starts its execution time before it, so who waited for
  whom still holds (a NCCL kernel's time is mostly waiting for the last member), the
  job's step times do not;
* ``proxy_trace`` ``proxy_op`` records: a :class:`~schemas.records.ProxySummary`, with
  the time spent in each wait state from its steps where they are given;
* a process's global rank is its rank in the largest communicator (the world's, which
  every process has); a communicator's members follow from the processes that report
  on it; the job record says the world's size and no layout.

Records are returned in time order at :meth:`InspectorReader.finish`; an offline
import (:func:`import_files`) reads every file first.

>>> reader = InspectorReader("j")
>>> marker = {"header": {"id": "0x7f01", "rank": 1, "n_ranks": 2, "nnodes": 1},
...           "metadata": {"inspector_output_format_version": "v4.3", "hostname": "gpu-3",
...                        "pid": 9, "dump_timestamp_us": 2_000_000},
...           "dump_stats": {"coll_records": 1, "p2p_records": 0}}
>>> op = {"coll_perf": {"coll": "AllReduce", "coll_sn": 4, "coll_msg_size_bytes": 8192,
...                     "coll_exec_time_us": 50, "coll_busbw_gbs": 1.0}}
>>> reader.feed("f", [marker, op])
>>> [(r.rank, r.seq, r.comm_size) for r in reader.finish() if isinstance(r, Collective)]
[(1, 4, 2)]
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec

from producers.nccl_inspector_ops import OPS, US, Context, Op, ProxyOp, comm_hash, proxy_op
from schemas.enums import CommRole, Direction, DType
from schemas.files import InputFileError, lines
from schemas.records import Collective, CommInfo, JobInfo, ProxySummary, RankInfo


class InspectorFormatError(ValueError):
    """Inspector output that cannot be read (with the file, the line and why)."""


class InspectorReader:
    """The Inspector's lines in, records out (see the module docstring)."""

    def __init__(self, job: str) -> None:
        self.job = job
        self.skipped: dict[str, int] = {}
        self.dropped = 0  # operations the Inspector itself says it overwrote
        self._contexts: dict[str, Context] = {}
        self._ops: list[Op] = []
        self._proxies: list[ProxyOp] = []
        self._members: dict[str, dict[int, tuple[str, int]]] = {}  # comm -> rank -> process
        self._sizes: dict[str, int] = {}
        self._told_world = 0
        #: the ranks are the processes' order (no communicator holds them all), not theirs
        self.numbered = False
        self._told_ranks: set[int] = set()
        self._told_comms: set[str] = set()

    def _skip(self, why: str) -> None:
        self.skipped[why] = self.skipped.get(why, 0) + 1

    def feed(self, source: str, lines: Iterable[str | bytes | dict[str, Any]]) -> None:
        """Lines (or decoded objects) of one file, in order; a line that is not Inspector
        output is counted in :attr:`skipped`."""
        ctx = self._contexts.setdefault(source, Context())
        for line in lines:
            if isinstance(line, dict):
                rec = line
            else:
                text = line.decode(errors="replace") if isinstance(line, bytes) else line
                if not text.strip():
                    continue
                try:
                    rec = json.loads(text)
                except ValueError:
                    self._skip("a line that is not JSON")
                    continue
            if not isinstance(rec, dict):
                self._skip("a JSON value that is not an object")
                continue
            self._record(ctx, rec)

    def _record(self, ctx: Context, rec: dict[str, Any]) -> None:
        if "dump_stats" in rec:
            stats = rec.get("dump_stats") or {}
            self.dropped += int(stats.get("coll_dropped_since_last_dump", 0) or 0)
            self.dropped += int(stats.get("p2p_dropped_since_last_dump", 0) or 0)
            ctx.header, ctx.metadata = rec.get("header"), rec.get("metadata")
            ctx.remaining = {
                "coll_perf": int(stats.get("coll_records", 0) or 0),
                "p2p_perf": int(stats.get("p2p_records", 0) or 0),
                "proxy_trace": int(stats.get("proxy_records", 0) or 0),
            }
            return
        header = rec.get("header", ctx.header)
        metadata = rec.get("metadata", ctx.metadata)
        if not isinstance(header, dict) or not isinstance(metadata, dict):
            self._skip("a record with no communicator (no header before it)")
            return
        for kind in ("coll_perf", "p2p_perf", "proxy_trace"):
            if isinstance(rec.get(kind), dict):
                if "header" not in rec and ctx.remaining.get(kind, 0) > 0:
                    ctx.remaining[kind] -= 1
                try:
                    self._operation(kind, rec[kind], header, metadata)
                except (KeyError, TypeError, ValueError) as e:
                    self._skip(f"a {kind} record without a readable {e}")
                return
        self._skip("a record of no kind the Inspector writes")

    def _operation(
        self, kind: str, body: dict[str, Any], header: dict[str, Any], meta: dict[str, Any]
    ) -> None:
        process = (str(meta.get("hostname", "")), int(meta.get("pid", 0)))
        comm = str(header["id"])
        rank, n = int(header["rank"]), int(header["n_ranks"])
        self._members.setdefault(comm, {})[rank] = process
        self._sizes[comm] = n
        dump_ns = int(meta.get("dump_timestamp_us", 0)) * US
        if kind == "proxy_trace":
            if body.get("record_type") == "proxy_op":
                self._proxies.append(proxy_op(process, comm, body, dump_ns))
            return  # a step's own record: its op's summary carries it
        prefix = "coll" if kind == "coll_perf" else "p2p"
        name = str(body[prefix]).lower()
        op = OPS.get(name)
        if op is None:
            raise ValueError(f"operation {body[prefix]!r}")
        ts = body.get("event_trace_ts") or {}
        kernels = ts.get("kernel_events") or []
        starts = [k["kernel_start_ts"] for k in kernels if k.get("kernel_start_ts")]
        stops = [k["kernel_stop_ts"] for k in kernels if k.get("kernel_stop_ts")]
        start = ts.get(f"{prefix}_start_ts")
        self._ops.append(
            Op(
                process=process,
                comm=comm,
                comm_rank=rank,
                n_ranks=n,
                op=op,
                sn=int(body[f"{prefix}_sn"]),
                size_bytes=int(body[f"{prefix}_msg_size_bytes"]),
                exec_ns=int(float(body[f"{prefix}_exec_time_us"]) * US),
                dump_ns=dump_ns,
                start_ns=int(start) * US if start else None,
                kernel_start_ns=min(starts) * US if starts else None,
                kernel_stop_ns=max(stops) * US if stops else None,
                peer=int(body["p2p_peer"]) if prefix == "p2p" else None,
                algo=body.get("coll_algo"),
                proto=body.get("coll_proto"),
            )
        )

    # ------------------------------------------------------------------ records
    def _global_ranks(self) -> dict[tuple[str, int], int]:
        """Each process's rank: its rank in the world's communicator (the largest one, on
        which every process seen so far reported, whether or not all its members have yet:
        a rank read from it never changes as more files arrive), else the processes
        numbered by host and process id (the Inspector names no global rank; :attr:`numbered`
        says so)."""
        processes = sorted({p for m in self._members.values() for p in m.values()})
        if not processes:
            return {}
        largest = max(self._sizes[c] for c in self._members)
        worlds = [
            c
            for c, m in self._members.items()
            if self._sizes[c] == largest and len(m) == len(processes)
        ]
        if worlds:
            self.numbered = False
            return {p: r for r, p in self._members[min(worlds)].items()}
        self.numbered = True
        return {p: i for i, p in enumerate(processes)}

    def finish(self) -> list[msgspec.Struct]:
        """Every record not returned yet, metadata first, then in time order (the end of an
        offline import: every process has reported)."""
        return self.drain(final=True)

    def drain(self, final: bool = False) -> list[msgspec.Struct]:
        """The records of what was fed since the last call, in time order, with the job's,
        ranks' and communicators' records the first time they are known (tailing: a
        process's operations wait until its rank in the world is known; a transfer's until
        its peer's process reported on the communicator, or ``final``)."""
        ranks = self._global_ranks()
        if not ranks:
            return []
        world = max(ranks.values()) + 1
        if not self.numbered:  # the world's communicator says its size before all report
            world = max(world, *(self._sizes[c] for c in self._members))
        first = min((o.start_ns or o.dump_ns for o in self._ops), default=0)
        out: list[msgspec.Struct] = []
        if world != self._told_world:
            self._told_world = world
            # the world's size, and no layout (the Inspector does not know one)
            out.append(JobInfo(job=self.job, ts_ns=first, source="nccl-inspector",
                               world_size=world, tp=1, pp=1, dp=1))  # fmt: skip
        for (host, _), rank in sorted(ranks.items(), key=lambda x: x[1]):
            if rank not in self._told_ranks:
                self._told_ranks.add(rank)
                out.append(RankInfo(job=self.job, ts_ns=first, rank=rank,
                                    node=host or "unknown", gpu=0))  # fmt: skip
        members: dict[str, list[int]] = {}
        for comm, by_rank in self._members.items():
            if len(by_rank) != self._sizes[comm]:
                continue  # not every member reported yet
            members[comm] = [ranks[by_rank[r]] for r in sorted(by_rank)]
            if comm not in self._told_comms:
                self._told_comms.add(comm)
                out.append(
                    CommInfo(
                        job=self.job,
                        ts_ns=first,
                        comm_hash=comm_hash(comm),
                        role=CommRole.WORLD if len(by_rank) == world else CommRole.OTHER,
                        ranks=members[comm],
                        name=f"inspector {comm}",
                        inferred=True,
                    )
                )
        ends = self._common_ends()
        calls: list[Collective] = []
        waiting: list[Op] = []
        for o in self._ops:
            c = self._collective(o, ranks, members, ends, final)
            if c is None and not final and o.process in ranks:
                waiting.append(o)
            elif c is not None:
                calls.append(c)
        proxies = [p for p in (self._proxy_summary(x, ranks, members) for x in self._proxies) if p]
        self._ops, self._proxies = waiting, []
        calls.sort(key=lambda c: c.enqueue_ns)
        proxies.sort(key=lambda p: p.first_ns)
        return [*out, *calls, *proxies]

    def _common_ends(self) -> dict[tuple[str, bool, int], int]:
        """For operations without an event trace: one end per instance, the earliest of its
        members' dumps (see the module docstring)."""
        ends: dict[tuple[str, bool, int], int] = {}
        for o in self._ops:
            if o.kernel_stop_ns is None and o.start_ns is None:
                key = (o.comm, o.peer is not None, o.sn)
                ends[key] = min(ends.get(key, o.dump_ns), o.dump_ns)
        return ends

    def _collective(
        self, o: Op, ranks: dict, members: dict[str, list[int]], ends: dict, final: bool
    ) -> Collective | None:
        if o.process not in ranks:
            return None
        peer = None
        if o.peer is not None:
            m = members.get(o.comm)
            if m is None or not 0 <= o.peer < len(m):
                if final:
                    self._skip("a transfer whose peer's process did not report")
                return None
            peer = m[o.peer]
        if o.kernel_stop_ns is not None or o.start_ns is not None:
            end = o.kernel_stop_ns or (o.start_ns or 0) + o.exec_ns
            kstart = o.kernel_start_ns or end - o.exec_ns
            enqueue = min(o.start_ns or kstart, kstart)
        else:
            end = ends[(o.comm, o.peer is not None, o.sn)]
            kstart = enqueue = end - o.exec_ns
        return Collective(
            job=self.job,
            node=o.process[0] or "unknown",
            rank=ranks[o.process],
            comm_hash=comm_hash(o.comm),
            comm_size=o.n_ranks,
            rank_in_comm=o.comm_rank,
            op=o.op,
            seq=o.sn,
            count=o.size_bytes,
            size_bytes=o.size_bytes,
            dtype=DType.UINT8,
            enqueue_ns=max(0, enqueue),
            start_ns=max(0, kstart),
            end_ns=max(0, end),
            peer=peer,
            algo=o.algo,
            proto=o.proto,
        )

    def _proxy_summary(
        self, p: ProxyOp, ranks: dict, members: dict[str, list[int]]
    ) -> ProxySummary | None:
        m = members.get(p.comm)
        if m is None or not 0 <= p.peer < len(m):
            self._skip("a proxy operation whose peer's process did not report")
            return None
        return ProxySummary(
            job=self.job,
            node=p.process[0] or "unknown",
            rank=ranks[p.process],
            comm_hash=comm_hash(p.comm),
            seq=p.parent_sn,
            channel=p.channel,
            peer=m[p.peer],
            direction=Direction.SEND if p.send else Direction.RECV,
            steps_posted=p.steps,
            steps_done=min(p.done, p.steps),
            size_bytes=p.size_bytes,
            first_ns=p.first_ns,
            last_ns=max(p.last_ns, p.first_ns),
            **p.waits,
        )


def import_files(paths: Iterable[Path], job: str) -> tuple[list[msgspec.Struct], InspectorReader]:
    """Every record of the Inspector's files (or directories of them), and the reader (what
    it skipped, what the Inspector said it dropped)."""
    reader = InspectorReader(job)
    files = [f for p in map(Path, paths) for f in (sorted(p.rglob("*")) if p.is_dir() else [p])]
    files = [f for f in files if f.is_file()]
    if not files:
        raise InspectorFormatError("no Inspector output files given")
    for f in files:
        try:
            reader.feed(str(f), lines(f))
        except InputFileError as e:  # compressed, and cut short or damaged
            raise InspectorFormatError(str(e)) from None
    records = reader.finish()
    if not records:
        raise InspectorFormatError(
            f"no Inspector records in {len(files)} file(s) ({reader.skipped or 'empty'})"
        )
    return records, reader


__all__ = ["InspectorFormatError", "InspectorReader", "import_files"]
