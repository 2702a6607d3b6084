"""A step folder's state as earlier versions pickled it, brought to this one.

Bytewax keeps each communicator's :class:`~detectors.folder.StepFolder` in its
recovery snapshots, so a flow upgraded over a recovery store resumes from state an
earlier version wrote: its step clock's fields kept in the folder itself, or no clock
at all (every instance placed by the layout).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from detectors.step_clock import StepClock

if TYPE_CHECKING:
    from detectors.folder import StepFolder

#: the clock's state, as a folder that kept it in itself pickled it
OLD_CLOCK_STATE = {
    "cycles": "cycles", "_agree": "agree", "_told": "told", "_mark_ends": "mark_ends",
    "_mark_step": "mark_step", "_marker_rank": "marker_rank", "_offset": "offset",
    "_votes": "votes", "_distrust": "distrust",
}  # fmt: skip

#: what a folder that placed every instance by the layout kept, and goes on with
_LAYOUT_STATE = ("topo", "comm_hash", "job", "role", "_parts", "_newest", "_partial",
                 "_last_arrival", "_last_end", "_reported")  # fmt: skip


def restore(folder: StepFolder, state: dict[str, Any]) -> None:
    """``folder`` set from ``state`` (its ``__dict__`` as this version or an earlier one
    pickled it)."""
    if "cycles" in state:  # its clock kept in the folder itself
        clock = state["clock"] = StepClock(state.pop("_trust_layout", False))
        for old, new in OLD_CLOCK_STATE.items():
            if old in state:
                setattr(clock, new, state.pop(old))
    if "clock" in state:
        folder.__dict__.update(state)
        return
    # pickled by a version that placed every instance by the layout: it goes on so
    folder._reset()
    folder.clock.trust_layout = True
    for name in _LAYOUT_STATE:
        if name in state:
            setattr(folder, name, state[name])


__all__ = ["OLD_CLOCK_STATE", "restore"]
