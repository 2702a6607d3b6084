"""A job analyzer's state as earlier versions pickled it, brought to this one.

Bytewax keeps each job's :class:`~detectors.job.JobAnalyzer` in its recovery
snapshots, so a flow upgraded over a recovery store resumes from state an earlier
version wrote: the hang watchdog's fields kept in the job itself, the GPU-wait
baseline as a plain dict, the step-time incidents as parallel dicts keyed by culprit
strings before they had trackers of their own, and the job's own step folders.
"""

from __future__ import annotations

from typing import Any

from detectors.cpu_wait import CpuWaits
from detectors.gpu_wait import GpuWaitBaseline
from detectors.incidents import Culprit, Incident, StepTimeLedger
from detectors.job_folders import JobFolders
from detectors.link_tracker import LinkTracker
from detectors.saves import Saves
from detectors.slowdown_tracker import SlowdownTracker
from detectors.watchdog import HangWatch

#: the hang watchdog's state, as a version that kept it in the job pickled it
OLD_HANG_STATE = {
    "partials": "partials", "stuck": "stuck", "last_progress_ns": "last_progress_ns",
    "hb_latest": "hb_latest", "hb_done": "hb_done", "hb_progress_ns": "hb_progress_ns",
    "hb_now_ns": "hb_now_ns", "hang_open": "open", "_hang_detected_ns": "detected_ns",
    "_final": "final",
}  # fmt: skip


def upgrade(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (a job analyzer's ``__dict__`` as pickled) in this version's shape."""
    if "hangs" not in state:  # pickled before the watchdog had a class of its own
        hangs = HangWatch()
        for old, new in OLD_HANG_STATE.items():
            if old in state:
                setattr(hangs, new, state.pop(old))
        hangs.starting = not (hangs.hb_progress_ns or hangs.last_progress_ns)
        state["hangs"] = hangs
    if isinstance(state.get("gpu_wait"), dict):  # kept as a plain dict before
        gpu_wait = GpuWaitBaseline()
        gpu_wait._ranks = state["gpu_wait"]
        state["gpu_wait"] = gpu_wait
    if "ledger" not in state:  # pickled before the incidents had trackers of their own
        _trackers(state)
    if "cpu" not in state:  # pickled before heartbeats carried the ranks' CPU wait
        state["cpu"] = state["slowdowns"].cpu = CpuWaits()
    if "saves" not in state:  # pickled before heartbeats carried the ranks' saves
        state["saves"] = state["slowdowns"].saves = Saves()
    if "own" not in state:  # the job's own folders, kept in the job itself before
        own = state["own"] = JobFolders()
        own.structure = state.pop("structure", {})
        own.folders = state.pop("folders", {})
        own.elsewhere = state.pop("folded_elsewhere", set())
        own.marks = state.pop("marks", {})
    return state


def _trackers(state: dict[str, Any]) -> None:
    st, book, gpu_wait = state["settings"], state["book"], state["gpu_wait"]
    ledger = StepTimeLedger(state.pop("shift"), min_shift=st.min_shift)
    ledger.recent = state.pop("recent")
    ledger.onset_at = {Culprit.parse(k): v for k, v in state.pop("onset_at").items()}
    ledger.onset_level = {Culprit.parse(k): v for k, v in state.pop("onset_level").items()}
    links = LinkTracker(book, ledger, gpu_wait, st.warmup_steps, st.link_drop)
    links.proxy_links = state.pop("proxy_links")
    links.edges = {e: Culprit.parse(k) for e, k in state.pop("link_culprits").items()}
    links.edge_onset = state.pop("link_onset")
    links.seen = state.pop("link_seen")
    links.incidents = {
        Culprit.parse(k): Incident(Culprit.parse(k), **fields)
        for k, fields in state.pop("link_fields").items()
    }
    slowdowns = SlowdownTracker(
        book, ledger, links, gpu_wait, warmup=st.warmup_steps, node_margin=st.node_margin,
        alpha=st.alpha, host_lead_drop=st.host_lead_drop, link_wait_ms=st.link_wait_ms,
        settle_s=st.settle_s, transient_min_lost_ms=st.transient_min_lost_ms,
    )  # fmt: skip
    slowdowns.localizer = state.pop("localizer")
    slowdowns.open = [Culprit.parse(k) for k in state.pop("slow_open")]
    slowdowns.bursts = {Culprit.parse(k): v for k, v in state.pop("bursts").items()}
    slowdowns.pending = state.pop("pending_shift")
    state.update(ledger=ledger, links=links, slowdowns=slowdowns)


__all__ = ["OLD_HANG_STATE", "upgrade"]
