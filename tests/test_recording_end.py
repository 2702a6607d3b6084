"""A recording that ends in a hang, from a source with no heartbeats (the original tool's
call logs, a profiler's trace): its end is no silence the analysis can time, so the call
it ended in is judged by how long it had stayed open, against how long its
communicator's calls ever did. Real jobs of the lab, their heartbeats left out: a rank
stopped (SIGSTOP) or killed while the others went on for a while is named; the same
jobs healthy, or cut while they ran, give no hang."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from producers.megatrace_lines import parse_line
from producers.megatrace_run import import_dir
from producers.megatron_config import read_megatron_config
from producers.sim.scenarios import build
from schemas.enums import VerdictKind
from schemas.records import Collective, Heartbeat
from tests.call_logs import write_logs
from tests.recordings import case_records, replayed


def _without_heartbeats(records: list) -> list:
    return [r for r in records if not isinstance(r, Heartbeat)]


@pytest.mark.parametrize(
    ("run", "case", "rank"),
    [
        ("run1", "megatron-hang", 2),  # a pipeline: its other stages went on to the step's end
        ("run1", "moe-hang", 2),
        ("run1", "zero-hang", 2),
        ("run2", "ddp-hang", 2),
        ("run2", "custom-hang", 2),
        ("run1", "moe-killed", 3),
        ("run2", "ddp-killed", 3),
    ],
)
def test_a_hang_the_recording_ended_in_is_named_without_heartbeats(
    run: str, case: str, rank: int
) -> None:
    (v,) = replayed(_without_heartbeats(case_records(run, case)))
    assert (v.kind, v.rank) == (VerdictKind.HANG, rank)
    assert "the recording ended there" in v.summary


@pytest.mark.parametrize("case", ["ddp-healthy", "megatron-healthy", "moe-healthy"])
def test_a_healthy_job_cut_while_it_ran_is_no_hang(case: str) -> None:
    """The recording stopped mid-step (every rank's records at once, calls still open at
    the cut left unfinished), at several points of the job: the calls it ends in are ones
    the ranks still join as they always did."""
    records = _without_heartbeats(case_records("run1", case))
    calls = [r for r in records if isinstance(r, Collective)]
    first, last = min(c.enqueue_ns for c in calls), max(c.enqueue_ns for c in calls)
    for k in range(1, 8):
        cut = first + (last - first) * k // 8
        kept = []
        for r in records:
            if isinstance(r, Collective):
                if r.enqueue_ns > cut:
                    continue
                if r.end_ns is not None and r.end_ns > cut:
                    r = msgspec.structs.replace(r, end_ns=None)
            elif (getattr(r, "ts_ns", None) or getattr(r, "end_ns", None) or 0) > cut:
                continue
            kept.append(r)
        assert not [v for v in replayed(kept) if v.kind is VerdictKind.HANG], (case, k)


def _cut_logs(src: Path, dst: Path, at_ns: int, stopped: int | None, went_on_ns: int) -> Path:
    """The original tool's logs of ``src`` as a recording that ended: every rank's call log
    up to ``at_ns`` + ``went_on_ns``, rank ``stopped``'s (None: none) up to ``at_ns``; its
    other files as they are, but the NICs' throughput logs (they would go on to the job's
    end)."""
    dst.mkdir()
    for f in src.iterdir():
        if "_Port" in f.name:
            continue
        if not f.name.startswith("rank_"):
            (dst / f.name).write_bytes(f.read_bytes())
            continue
        end = at_ns + (0 if f.name == f"rank_{stopped}.log" else went_on_ns)
        kept = [ln for ln in f.read_text().splitlines() if parse_line(ln).ts_ns <= end]
        (dst / f.name).write_text("".join(ln + "\n" for ln in kept))
    return dst


def test_a_rank_that_stopped_in_the_original_tool_s_logs_is_named(tmp_path: Path) -> None:
    """A pipeline job's call logs (no heartbeats, no ids) that end because one rank of
    its second stage stopped while the others went on for most of a step: that rank is
    named, not the first stage's ranks, still draining their backward when the
    recording ended and missing from calls the later stages had begun (they were seen
    calling since); the same logs cut at one moment, at several points, are no hang."""
    run = build("healthy", scale="tiny", seed=3)
    records = list(run.records(emit_kernels=False))
    logs = tmp_path / "logs"
    config = write_logs(run, records, logs, ids=False, save_count=False)
    calls = sorted(r.enqueue_ns for r in records if isinstance(r, Collective))
    step_ns = (calls[-1] - calls[0]) // run.steps
    stage = run.spec.tp * run.spec.dp  # ranks per pipeline stage
    for k, stopped in enumerate((stage, stage + 1, 2 * stage - 1)):
        at = calls[0] + (calls[-1] - calls[0]) * (3 + 2 * k) // 10
        d = tmp_path / f"stopped{stopped}"
        _cut_logs(logs, d, at, stopped, went_on_ns=step_ns * 6 // 10)
        got, _ = import_dir(d, read_megatron_config(config), "j")
        hangs = [v for v in replayed(got) if v.kind is VerdictKind.HANG]
        assert [v.rank for v in hangs] == [stopped], (stopped, [v.summary for v in hangs])
        d = tmp_path / f"cut{k}"
        _cut_logs(logs, d, at, None, went_on_ns=0)
        got, _ = import_dir(d, read_megatron_config(config), "j")
        assert not [v for v in replayed(got) if v.kind is VerdictKind.HANG], k


#: the published MEGATRACE example (Infrawaves/Megatrace ``example/TP2PP4DP8``: 64 GPUs,
#: TP 2 x PP 4 x DP 8, call logs with neither opCount nor groupHash), its first 11
#: iterations and a fifth of the twelfth: every line of each rank's log up to then, and
#: its training log's lines up to the last iteration that ended by then
EXAMPLE = Path(__file__).parent / "data" / "megatrace_tp2pp4dp8_prefix.tar.xz"
EXAMPLE_END_NS = 1_746_686_473_370_000_000  # where its logs were cut


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import tarfile

    root = tmp_path_factory.mktemp("example")
    with tarfile.open(EXAMPLE) as t:
        t.extractall(root, filter="data")
    return root / "TP2PP4DP8"


def test_a_rank_that_stopped_in_a_real_run_s_logs_is_named(example: Path, tmp_path: Path) -> None:
    """The published example's logs, ended as if rank 40 (its third pipeline stage) had
    stopped 0.2 s before the others' logs end: rank 40 is named, not the 16 ranks of the
    first stage, which were still draining their backward and had not yet joined the
    job-wide all-reduce the later stages had begun (they were seen calling since); the
    same logs cut at one moment (every rank's at once) are no hang."""
    at, went_on = EXAMPLE_END_NS - 200_000_000, 200_000_000
    got, _ = import_dir(_cut_logs(example, tmp_path / "stopped", at, 40, went_on), None, "ex")
    (v,) = [v for v in replayed(got) if v.kind is VerdictKind.HANG]
    assert (v.rank, v.culprit_ranks or [v.rank]) == (40, [40]), v.summary
    assert "the recording ended there" in v.summary
    got, _ = import_dir(_cut_logs(example, tmp_path / "cut", at, None, 0), None, "ex")
    assert not [v for v in replayed(got) if v.kind is VerdictKind.HANG]
