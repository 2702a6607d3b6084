"""A hang verdict, written: where the hung call sits, who and what it names, its text.

:class:`~detectors.watchdog.HangWatch` decides that the job hangs and diagnoses it
(:mod:`detectors.hang`); :func:`report_hang` turns the diagnosis into the verdict a user
reads: the call's op and which end of a transfer it is, its step, phase and micro-batch
in the schedule (through the job's :data:`Place`), the culprit's node and GPU, or the
link, and the summary from :func:`detectors.texts.hang_summary`. :func:`earliest_call`
picks, of several calls a rank never joined, the first in its stage's schedule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import msgspec
import numpy as np

from detectors import texts
from detectors.align import Instance
from detectors.hang import HangDiagnosis
from detectors.topology import Position, Topology
from detectors.verdicts import VerdictBook
from schemas.config import DetectSettings
from schemas.enums import Cause, CollOp, CommRole, Phase, VerdictKind

#: a hang in the network named by its nodes where its call spans this many at most
NAMED_NODES = 8

#: where a call sits in the schedule: (diagnosis, its partial instance or None, its op,
#: the sender's stage, the receiver's stage, when it began) -> a position, or None where
#: not known
Place = Callable[
    [HangDiagnosis, Instance | None, CollOp | None, int | None, int | None, int],
    Position | None,
]


class JobView(NamedTuple):
    """What the watchdog reads of its job when it judges."""

    topo: Topology
    book: VerdictBook
    expected_ns: float  # the job's expected step time (0: not known yet)
    coll_now_ns: int  # the newest time the collective records showed
    place: Place
    settings: DetectSettings = DetectSettings()
    #: each rank's newest call end in the steps still open (None: not known)
    last_seen: Callable[[], np.ndarray | None] = lambda: None


def report_hang(
    diag: HangDiagnosis,
    *,
    silent: int,
    detected: int,
    view: JobView,
    partial_of: Callable[[int, int, int], Instance | None],
    oldest_open: Callable[[int], Instance | None] = lambda comm_hash: None,
    progress_ns: int,
    reported: str | None,
    ended: str,
    saving: dict[int, int] | None = None,
) -> tuple[list[msgspec.Struct], str]:
    """The hang verdict of ``diag`` in the job's book, and its culprit key.

    ``partial_of(comm, sender, seq)``: the call's partial instance, where an aligner
    reported it; ``oldest_open(comm)``: the oldest partial instance of a communicator
    (a hang judged from heartbeats' counts, on a pipeline's, is placed by it);
    ``progress_ns``: the job's last progress (the onset where nothing
    earlier is known); ``reported``: the culprit of the hang already reported (one
    incident, renamed); ``ended``: what ended in this hang (the recording, the job's
    processes), or ""; ``saving``: the ranks saving a checkpoint, and since when (a
    save that went on too long is the hang).
    """
    topo = view.topo
    role = topo.role(diag.comm_hash)
    members = tuple(topo.comms[diag.comm_hash].ranks) if diag.comm_hash in topo.comms else ()
    rank, op, sender = diag.culprit_rank, diag.op, diag.sender
    if role is CommRole.PP and sender < 0:
        # which end sends: the partial instance knows; else the lower stage (forward)
        found = [s for s in members if partial_of(diag.comm_hash, s, diag.seq)]
        oldest = oldest_open(diag.comm_hash) if not found and diag.counted else None
        if oldest is not None:
            # a heartbeat counts a pair's transfers both ways (or none): its count is no
            # transfer's sequence number; the oldest transfer open on it is where it stands
            diag, found = dataclasses.replace(diag, seq=oldest.seq), [oldest.sender]
        sender = found[0] if found else (diag.link[0] if diag.link else members[0])
    partial = partial_of(diag.comm_hash, sender, diag.seq)
    if op is None and partial is not None:
        op = partial.op
    if role is CommRole.PP:
        op = CollOp.SEND if rank is not None and rank == sender else CollOp.RECV
    sender_stage = topo.coords(sender)[0] if sender >= 0 else None
    to = partial.receiver if partial is not None else -1
    receiver_stage = topo.coords(to)[0] if to >= 0 else None
    onset = diag.first_wait_ns or (partial.first_arrival_ns if partial else 0) or progress_ns
    pos = view.place(diag, partial, op, sender_stage, receiver_stage, onset)
    fields: dict[str, object] = {
        "comm_hash": diag.comm_hash,
        "seq": diag.seq,
        "op": op,
        "step": pos.step if pos else None,
        "microbatch": pos.microbatch if pos else None,
        "phase": Phase(pos.phase) if pos else None,
    }
    if rank is not None:
        stage = topo.coords(rank)[0]  # (none where the job claims no pipeline it has)
        fields.update(rank=rank, node=topo.node(rank), gpu=topo.gpu(rank),
                      pp_stage=stage if stage < topo.job.pp else None)  # fmt: skip
    several = [r for r in diag.missing if r is not None]
    if len(several) > 1 and diag.cause == Cause.COMPUTE:
        fields["culprit_ranks"] = several
    link: str | None = None
    if diag.link:
        link = topo.link_name(*diag.link)
        fields.update(src_rank=diag.link[0], dst_rank=diag.link[1])
    elif diag.unwitnessed:
        # no proxy operation names the edge: the network between the call's nodes, as a
        # slower one is named from transfer times ("a<->b"), where they are few enough
        # to be a lead (a world communicator's thousands of nodes are none)
        nodes = sorted({topo.node(r) for r in members})
        if 1 < len(nodes) <= NAMED_NODES:
            link = "<->".join(nodes)
    if link is not None:
        fields["link"] = link
    on_link = diag.link is not None and diag.cause != Cause.COMPUTE
    culprit = f"link:{diag.link[0]}->{diag.link[1]}" if on_link else f"rank:{rank}"
    if reported:
        view.book.rename(VerdictKind.HANG.value, reported, culprit)
    phase = fields["phase"]
    where = texts.where(pos.step if pos else None, phase.value if phase else None,
                        pos.microbatch if pos else None, fields.get("pp_stage"))  # fmt: skip
    summary = texts.hang_summary(
        cause=diag.cause,
        call=op.value if op else "its next collective",
        role=role.value,
        seq=diag.seq,
        where=where or "an unknown position",
        rank=rank,
        gpu=topo.gpu(rank) if rank is not None else None,
        node=topo.node(rank) if rank is not None else None,
        several=(several, sorted({topo.node(r) for r in several})),
        waiting=len(diag.waiting),
        link=link,
        producing=diag.link is not None and rank == diag.link[0],
        ended=ended,
    )
    ev = {**diag.evidence, "silent_ns": float(silent), "expected_step_ns": view.expected_ns}
    if ended:
        ev["recording_ended" if "recording" in ended else "processes_ended"] = 1.0
    since = (saving or {}).get(rank) if rank is not None else None
    if since is not None:
        ev["saving_ns"] = float(detected - since)
        summary += texts.still_saving(detected - since)
    v = view.book.report(
        VerdictKind.HANG,
        diag.cause,
        culprit,
        onset_step=pos.step if pos else None,
        onset_ns=onset,
        detected_ns=detected,
        severity=1.0,
        confidence=0.95,
        summary=summary,
        evidence=ev,
        **fields,
    )
    return ([v] if v else []), culprit


def earliest_call(topo: Topology, diag: HangDiagnosis) -> HangDiagnosis:
    """Of the calls the culprit never joined, the one earliest in its stage's schedule."""
    assert diag.culprit_rank is not None
    stage = topo.coords(diag.culprit_rank)[0]
    order = {node: i for i, node in enumerate(topo.stage_order(stage))}

    def when(alt: tuple[int, int]) -> tuple[int, int, int]:
        comm, seq = alt
        info = topo.comms.get(comm)
        sender_stage = info.pp_stage if info is not None else None
        pos = topo.position(comm, seq, CollOp.SEND, sender_stage)
        if pos is None:
            return (1 << 30, 1 << 30, 9)
        idx = order.get((pos.phase, pos.microbatch), len(order))
        # inside a node: a forward receives from upstream before it computes and sends;
        # a backward receives from downstream first
        sub = 0
        if info is not None and info.role.value == "pp":
            upper = diag.culprit_rank == info.ranks[-1]
            sub = -1 if upper == (pos.phase == Phase.FORWARD.value) else 1
        return (pos.step, idx, sub)

    comm, seq = min(diag.alternatives, key=when)
    return dataclasses.replace(diag, comm_hash=comm, seq=seq, sender=-1, op=None)


__all__ = ["JobView", "Place", "earliest_call", "report_hang"]
