"""Verdicts on a real mixture-of-experts job kept from `megatrace lab` (workload `moe`:
four ranks on two nodes, expert-parallel pairs within a node, each expert's gradients
all-reduced with the rank holding the same expert on the other node; see
`producers/lab/moe.py`)."""

from __future__ import annotations

import pytest

from schemas.records import CommInfo
from tests.recordings import ORDERS, last_verdicts, read_records

RECORDING = "lab_moe_slow_link.jsonl.gz"


@pytest.mark.parametrize("order", ORDERS)
def test_a_link_degraded_under_a_large_sync_is_that_link_not_a_hang_every_step(
    order: str,
) -> None:
    """Case moe-slow-link: lab-n1's link limited to 100 Mbit/s (tbf) from step 12. The
    experts' 4.7 MB gradient sync crosses it and takes 1.5 s where a whole step took
    90 ms: every step, the job is silent three times as long as the floor of a hang,
    then moves. Every member posted the sync and nothing counts its transfer's progress
    (Gloo): a slow transfer, not a hang, until it was silent ``stall_hang_s`` (5 s). No
    hang; the link is found as what slowed the job."""
    verdicts = last_verdicts(RECORDING, order)
    links = [v for v in verdicts if v.kind.value == "link_degradation"]
    assert [(v.link, v.onset_step) for v in links] == [("lab-n0<->lab-n1", 13)]
    assert not [v for v in verdicts if v.kind.value == "hang"]
    roles = {
        r.comm_hash: (r.role.value, tuple(r.ranks))
        for r in read_records(RECORDING)
        if isinstance(r, CommInfo)
    }
    # the collector, told ep 2, declared the expert-parallel pairs as such
    assert {("ep", (0, 1)), ("ep", (2, 3))} <= set(roles.values())
