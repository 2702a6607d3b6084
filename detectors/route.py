"""The detectors' keyed route, declared once: each stage's key, its pure state and where
its outputs go.

======== ======================= ============= ====================================
stage    key                     state         its outputs go to
======== ======================= ============= ====================================
schedule job                     ScheduleBook  comm (schedules, iteration markers)
comm     job, communicator       CommAnalyzer  shard (parts, liveness), job (the
                                               rest), the store (aligned rows)
shard    job, shard of its comms PartMerger    job
node     job, node               NodeAnalyzer  job (digests of the links that changed)
job      job                     JobAnalyzer   the store, verdicts, alerts
======== ======================= ============= ====================================

The states are :class:`~detectors.schedule.ScheduleBook`,
:class:`~detectors.comm.CommAnalyzer`, :class:`~detectors.merge.PartMerger`,
:class:`~detectors.node.NodeAnalyzer` and :class:`~detectors.job.JobAnalyzer`.
Records enter where :func:`entry` says: collectives and proxy summaries at their
communicator, link samples at their node, kernels only in the store, everything else
(job metadata, heartbeats, iteration markers) at the job, and the metadata and
markers also at the schedule book. The Bytewax flow (:mod:`flows.main`) maps these
stages onto its operators with these keys; :class:`Route` runs them in one process,
offline and in tests (:class:`~detectors.replay.Replay`), with an optional hook that
times each stage (``megatrace bench analyze``).

>>> from producers.sim.scenarios import build
>>> run = build("slow-link", scale="tiny", seed=0, steps=30)
>>> seconds = {}
>>> def hook(stage, s, outputs):
...     seconds[stage] = seconds.get(stage, 0.0) + s
>>> found = [v for v in Route(hook=hook).run(run.records()) if type(v).__name__ == "Verdict"]
>>> [(v.kind.value, v.link) for v in found][:1]
[('link_degradation', 'node-0/mlx5_2->node-1/mlx5_2')]
>>> sorted(seconds)
['comm', 'job', 'node', 'schedule', 'shard', 'timers']
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import msgspec

from detectors.comm import CommAnalyzer
from detectors.job import JobAnalyzer
from detectors.merge import CommLiveness, PartMerger, shard_of
from detectors.node import NodeAnalyzer
from detectors.parts import StepPart
from detectors.schedule import ScheduleBook, StepMark
from schemas.config import DetectSettings
from schemas.records import (
    Collective,
    CommInfo,
    Iteration,
    JobInfo,
    Kernel,
    LinkSample,
    ProxySummary,
)

#: records a poll of the flow holds (its Kafka source's batch): what a batched route
#: gathers (``megatrace analyze`` and ``eval`` replay recordings so)
POLL = 5000

#: (stage, seconds, its outputs): called after each stage's work on one key's items; the
#: stage is one of the table's, or ``timers`` (the communicators' and jobs' timers)
Hook = Callable[[str, float, list[Any]], None]


def entry(rec: Any) -> str:
    """The stage a record enters at (``store``: none, it is only stored); worked out once
    per type (every record is routed)."""
    stage = _ENTRY.get(type(rec))
    if stage is None:
        stage = _ENTRY[type(rec)] = _stage_of(rec)
    return stage


def _stage_of(rec: Any) -> str:
    if isinstance(rec, Collective | ProxySummary):
        return "comm"
    if isinstance(rec, LinkSample):
        return "node"
    return "store" if isinstance(rec, Kernel) else "job"


_ENTRY: dict[type, str] = {}


def schedules_it(rec: Any) -> bool:
    """The record also goes to the job's schedule book (communicators' schedules are made
    of it, or it marks a step)."""
    return isinstance(rec, JobInfo | CommInfo | Iteration)


def comm_key(job: str, comm_hash: int) -> str:
    return f"{job}:{comm_hash:016x}"


def node_key(job: str, node: str) -> str:
    return f"{job}:{node}"


def shard_key(job: str, comm_hash: int, shards: int) -> str:
    return f"{job}:{shard_of(comm_hash, shards)}"


def job_of(key: str) -> str:
    """The job of a communicator's, node's or shard's key."""
    return key.rsplit(":", 1)[0]


def to_shard(item: Any) -> bool:
    """A communicator's output merged per shard before its job (the rest goes straight)."""
    return isinstance(item, StepPart | CommLiveness)


class Route:
    """Every stage in one process: what the dataflow does, keyed the same way.

    Parameters
    ----------
    settings
        The detectors' settings.
    tick_ns
        The hang watchdog and the communicators' timers run every this much event time
        (the newest timestamp seen), as the flow's timers do.
    poll
        None: each record goes through at once. A number: records are gathered per
        communicator and per node and go through every ``poll`` records, as the flow
        batches a poll (each key's share of a poll is one batch), or sooner when their
        times reach the next tick (the flow's polls are short against its timers); the
        timers run between polls.
    hook
        Told each stage's time on each key's batch (see :data:`Hook`).
    rows
        The communicators' stored rows of each instance come out too (False: an
        analysis that reads only the verdicts and steps, at less cost).
    """

    def __init__(
        self,
        settings: DetectSettings | None = None,
        tick_ns: int = 50_000_000,
        poll: int | None = None,
        hook: Hook | None = None,
        rows: bool = True,
    ) -> None:
        self.settings = settings or DetectSettings()
        self.rows = rows
        self.tick_ns = tick_ns
        self.poll = poll
        self.hook = hook
        self.books: dict[str, ScheduleBook] = {}
        self.comms: dict[tuple[str, int], CommAnalyzer] = {}
        self.mergers: dict[tuple[str, int], PartMerger] = {}
        self.nodes: dict[tuple[str, str], NodeAnalyzer] = {}
        self.jobs: dict[str, JobAnalyzer] = {}
        self._pending: dict[tuple[str, Any], list[Any]] = {}  # (stage, key) -> its batch
        # while a poll goes through: job -> what its communicators and nodes sent it
        self._gathering: dict[str, list[Any]] | None = None
        self._seen = 0
        self._poll_ns = 0  # the newest time of the records in the poll
        self._flush_at = 0  # a poll goes through once its time reaches this
        self._next_tick = 0
        self.now_ns = 0

    def __setstate__(self, state: dict[str, Any]) -> None:
        defaults = {"poll": None, "hook": None, "nodes": {}, "_pending": {}, "_seen": 0,
                    "_poll_ns": 0, "_flush_at": 0, "rows": True, "_gathering": None}  # fmt: skip
        self.__dict__.update({**defaults, **state})  # one pickled before these existed

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "hook": None}  # a hook is the caller's, not state

    # ------------------------------------------------------------------ records
    def update(self, rec: Any) -> list[msgspec.Struct]:
        stage = _ENTRY.get(type(rec)) or entry(rec)
        if stage == "comm" and self.poll is not None:  # most records: gathered, and no
            gathered = self._pending.get(("comm", (rec.job, rec.comm_hash)))  # poll yet
            if gathered is not None:
                now = self.jobs[rec.job].now_ns  # (its job's analyzer came with the list)
                t = getattr(rec, "arrival_ns", 0)
                t = max(t, self._poll_ns)
                if (self._seen + 1) % self.poll and max(t, now) < self._flush_at:
                    gathered.append(rec)
                    self._seen += 1
                    self._poll_ns = t
                    if now > self.now_ns:
                        self.now_ns = now
                    return []
        job = getattr(rec, "job", None)
        if job is None:
            return []
        analyzer = self._job(job)
        out: list[msgspec.Struct] = []
        if stage in ("comm", "node"):
            key = (job, rec.comm_hash) if stage == "comm" else (job, rec.node)
            if self.poll is None:
                out += self._comm(key, [rec]) if stage == "comm" else self._node(key, [rec])
            else:  # every record of a recording comes this way: no list made for a key
                gathered = self._pending.get((stage, key))  # already gathering
                if gathered is None:
                    self._pending[(stage, key)] = [rec]
                else:
                    gathered.append(rec)
                t = rec.ts_ns if stage == "node" else getattr(rec, "arrival_ns", 0)
                if t > self._poll_ns:
                    self._poll_ns = t
        elif stage == "job":
            out += self._timed("job", analyzer.update, rec)
            if schedules_it(rec):
                book = self.books.setdefault(job, ScheduleBook())
                for s in self._timed("schedule", book.update, rec):
                    h = s.comm_hash if isinstance(s, StepMark) else s.comm.comm_hash
                    out += self._comm((job, h), [s])
        self._seen += 1
        # the poll's time: its records', or the job's own (heartbeats go on in a hang)
        t = max(self._poll_ns, analyzer.now_ns)
        polled = self.poll is None or self._seen % self.poll == 0 or t >= self._flush_at
        if self.poll is not None and polled:
            out += self._flush_poll()
            self._flush_at = t + self.tick_ns
        self.now_ns = max(self.now_ns, analyzer.now_ns)
        # batched, the timers run between polls: never while a communicator's records
        # wait in one (the flow's keys keep their own clocks)
        if polled and self.now_ns >= self._next_tick:
            out += self.tick(self.now_ns)
            self._next_tick = self.now_ns + self.tick_ns
        return out

    def run(self, records: Iterable[Any]) -> Iterator[msgspec.Struct]:
        for rec in records:
            yield from self.update(rec)
        yield from self.finish()

    def tick(self, now_ns: int) -> list[msgspec.Struct]:
        """Event time moved to ``now_ns``: the communicators' and jobs' timers."""
        out: list[msgspec.Struct] = []
        for (job, _), comm in self.comms.items():
            rows, items = self._timed("timers", comm.expire, now_ns)
            out += [*rows, *self._forward(job, items), *comm.stats()]
        for a in self.jobs.values():
            out += self._timed("timers", a.tick, now_ns)
        return out

    def finish(self) -> list[msgspec.Struct]:
        """End of input: what every stage still holds, in route order."""
        out = self._flush_poll() + self.tick(self.now_ns)
        for (job, _), comm in self.comms.items():
            rows, items = self._timed("comm", comm.flush)  # held and open instances
            out += [*rows, *self._forward(job, items), *comm.stats(final=True)]
        out += self._flush_poll()  # the parts those sent on, merged before the mergers end
        for (job, _), merger in self.mergers.items():
            for x in self._timed("shard", merger.flush):
                out += self._timed("job", self.jobs[job].update, x)
        for a in self.jobs.values():
            out += self._timed("job", a.finish)
        return out

    # ------------------------------------------------------------------ stages
    def _job(self, job: str) -> JobAnalyzer:
        a = self.jobs.get(job)
        if a is None:
            a = self.jobs[job] = JobAnalyzer(job, self.settings)
        return a

    def _timed(self, stage: str, call: Callable[..., Any], *args: Any) -> Any:
        if self.hook is None:
            return call(*args)
        t0 = time.perf_counter()
        out = call(*args)
        self.hook(stage, time.perf_counter() - t0, out if isinstance(out, list) else [out])
        return out

    def _comm(self, key: tuple[str, int], items: list[Any]) -> list[msgspec.Struct]:
        comm = self.comms.get(key)
        if comm is None:
            timeout_ns = int(self.settings.partial_timeout_ms * 1e6)
            comm = self.comms[key] = CommAnalyzer(min_timeout_ns=timeout_ns, keep_rows=self.rows)
        rows, forward = self._timed("comm", comm.update, items)
        return [*rows, *self._forward(key[0], forward)]

    def _node(self, key: tuple[str, str], samples: list[Any]) -> list[msgspec.Struct]:
        node = self.nodes.get(key)
        if node is None:
            st = self.settings
            node = self.nodes[key] = NodeAnalyzer(st.warmup_steps, st.link_drop)
        digest = self._timed("node", node.update, samples)
        return [] if digest is None else self._to_job(key[0], [digest])

    def _to_job(self, job: str, items: list[Any]) -> list[msgspec.Struct]:
        """What a communicator or node sends its job directly: to the job now, or while a
        poll goes through, with the poll's others for it (see :meth:`_flush_poll`)."""
        if self._gathering is not None:
            self._gathering.setdefault(job, []).extend(items)
            return []
        return self._timed("job", self.jobs[job].update_many, items) if items else []

    def _forward(self, job: str, items: Iterable[Any]) -> list[msgspec.Struct]:
        """A communicator's batch of items to its job; step parts and progress merged per
        shard, the shard's newest progress once per batch (as the flow's merge step)."""
        out: list[msgspec.Struct] = []
        analyzer = self.jobs[job]
        touched: dict[tuple[str, int], PartMerger] = {}
        direct: list[Any] = []  # to the job as one batch, as the flow's job step takes them
        for x in items:
            if not to_shard(x):
                direct.append(x)
                continue
            key = (job, shard_of(x.comm_hash, self.settings.part_shards))
            if self.poll is not None:  # merged with the poll's other parts of its shard
                self._pending.setdefault(("shard", key), []).append(x)
                continue
            out += self._to_job(job, direct)  # (unbatched: each merged part in its turn)
            direct = []
            merger = self.mergers.get(key) or self.mergers.setdefault(key, PartMerger())
            touched[key] = merger
            for y in self._timed("shard", merger.update, x):
                out += self._timed("job", analyzer.update, y)
        out += self._to_job(job, direct)
        for key in touched:
            out += self._shard(key, [])
        return out

    def _shard(self, key: tuple[str, int], parts: list[Any]) -> list[msgspec.Struct]:
        """A batch of one shard's parts merged, then the shard's newest progress."""
        merger = self.mergers.get(key) or self.mergers.setdefault(key, PartMerger())
        merged = self._timed("shard", lambda: [y for x in parts for y in merger.update(x)]
                             + merger.progress())  # fmt: skip
        out: list[msgspec.Struct] = []
        analyzer = self.jobs[key[0]]
        for y in merged:
            out += self._timed("job", analyzer.update, y)
        return out

    def _flush_poll(self) -> list[msgspec.Struct]:
        """Each key's share of the poll, as one batch."""
        out: list[msgspec.Struct] = []
        pending, self._pending = self._pending, {}
        shards: dict[Any, list[Any]] = {}  # parts sent on since the last poll (a marker's,
        # the timers'), then the poll's; what the communicators and nodes send their job
        # directly goes as one batch, in the same order, as the flow's job step takes a
        # poll's (one item at a time, each would find the job's state cold)
        gathered: dict[str, list[Any]] = {}
        self._gathering = gathered
        try:
            for (stage, key), items in pending.items():
                if stage == "shard":
                    shards[key] = items
                else:
                    out += self._comm(key, items) if stage == "comm" else self._node(key, items)
        finally:
            self._gathering = None
        for job, batch in gathered.items():
            out += self._timed("job", self.jobs[job].update_many, batch)
        for (_, key), parts in self._pending.items():
            shards.setdefault(key, []).extend(parts)
        self._pending = {}
        for key, parts in shards.items():
            out += self._shard(key, parts)
        return out


__all__ = ["POLL", "Hook", "Route", "comm_key", "entry", "job_of", "node_key", "schedules_it",
           "shard_key", "to_shard"]  # fmt: skip
