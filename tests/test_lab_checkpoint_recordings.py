"""Healthy real jobs that save checkpoints, kept from `megatrace lab` (cases
`ddp-checkpoint` and `megatron-checkpoint`, the Megatron one run for 30 steps): every
10 steps the writers (DDP's rank 0; Megatron's first data-parallel rank of each stage
and tensor slice: ranks 0, 1, 4 and 5) save, synced to disk, while everyone else waits
at a barrier. The collector saw the saves (`torch.save`, and the sync marked with
`torch_collector.saving()`), and its heartbeats said so."""

from __future__ import annotations

import msgspec
import pytest

from schemas.records import Heartbeat
from tests.recordings import ORDERS, read_records, replayed

RECORDINGS = ("lab_ddp_checkpoint.jsonl.gz", "lab_megatron_checkpoint.jsonl.gz")


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", RECORDINGS)
def test_a_job_saving_checkpoints_is_no_straggler_and_no_hang(name: str, order: str) -> None:
    assert replayed(read_records(name), order) == []


@pytest.mark.parametrize("name", RECORDINGS)
def test_without_the_saves_told_the_writers_look_like_stragglers_or_a_hang(name: str) -> None:
    """The same records, the heartbeats' save fields taken out (a source that does not
    see the saves): each checkpoint step is 10-15 times the usual, a writer last at the
    barrier, and verdicts name the writers, which is what the saves told prevent."""
    blind = [
        msgspec.structs.replace(r, save_ns=None, saving_since_ns=None)
        if isinstance(r, Heartbeat) else r
        for r in read_records(name)
    ]  # fmt: skip
    saved = {r.rank for r in read_records(name) if isinstance(r, Heartbeat) and r.save_ns}
    assert saved == ({0} if "ddp" in name else {0, 1, 4, 5})
    found = replayed(blind)
    assert found
    assert all(set(v.culprit_ranks or [v.rank]) <= saved for v in found if v.rank is not None)


@pytest.mark.parametrize("name", RECORDINGS)
def test_the_steps_a_checkpoint_took_are_left_out_and_say_so(name: str) -> None:
    """Each save makes a step 10-15 times the usual (and one that began in the step
    before, that one twice the usual): the detectors leave those steps out, and their
    rows say so (the job dashboard draws them apart); the others count."""
    from detectors.replay import Replay
    from schemas.results import StepSummary

    steps = [s for s in Replay().run(read_records(name)) if isinstance(s, StepSummary)]
    usual = sorted(s.duration_ns for s in steps)[len(steps) // 2]
    out = {s.step for s in steps if s.left_out}
    assert {s.step for s in steps if s.duration_ns > 5 * usual} <= out
    assert all(s.duration_ns >= 2 * usual for s in steps if s.step in out)
