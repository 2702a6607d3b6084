"""Hangs in the network of real jobs, kept from `megatrace lab` (`tests/corpus/netdown/run1`:
each workload's ``link-down`` case, ``megatrace lab --case ddp-link-down ...``). Node
lab-n1's link is set down at step 12 (8 for Megatron): every rank waits in a call whose
transfer cannot move, TCP retransmits into the link, and nothing in Gloo's calls counts
the transfer's progress. From the calls alone that is a slow transfer until it lasts; the
lab leaves the job hung 13 s, then ends it. ``run2`` keeps a sharded data-parallel job
one of whose ranks completed the hung all-gather (its share came before the link went)
and went on to the next call, which the others never reached; ``run3`` to ``run7`` the
five of each of five later live runs of the whole lab."""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas.codec import read_jsonl
from schemas.config import DetectSettings
from schemas.enums import Cause, VerdictKind
from tests.recordings import replayed

CORPUS = Path(__file__).parent / "corpus" / "netdown"
CASES = sorted(f"{run.name}/{p.name}" for run in CORPUS.iterdir() for p in run.iterdir())


@pytest.mark.parametrize("case", CASES)
def test_a_link_that_failed_under_a_real_job_is_one_hang_in_the_network(case: str) -> None:
    """One verdict: a hang on the network between the two nodes (the failed link's node at
    one end), told once the call was silent ``stall_hang_s`` and not much later (a slow
    transfer is as silent until then); no slowdown or degraded link put on the way."""
    (label,) = read_jsonl(CORPUS / case / "labels.jsonl")
    (hang,) = replayed(list(read_jsonl(CORPUS / case / "records.jsonl.gz")))
    assert (hang.kind, hang.cause) == (VerdictKind.HANG, Cause.NETWORK_LINK)
    assert hang.link == "lab-n0<->lab-n1" and label.node in hang.link.split("<->")
    stall = DetectSettings().stall_hang_s
    assert stall < hang.evidence["silent_ns"] / 1e9 < stall + 1.0
    assert "recording_ended" not in hang.evidence  # told while the job was still hung
    # where it stands: the step the hung call belongs to (rank 0 reached the label's step
    # as the link went down, so the call is of it or the next)
    assert hang.onset_step in (label.onset_step, label.onset_step + 1)
