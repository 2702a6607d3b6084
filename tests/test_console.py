"""The console's account of incidents: what a person reads, not every revision."""

from __future__ import annotations

import msgspec

from detectors.console import IncidentLog
from schemas.enums import Cause, Phase, VerdictKind, VerdictStatus
from schemas.results import Verdict


def _incident(**fields: object) -> Verdict:
    base = dict(
        job="j", verdict_id="v1", kind=VerdictKind.SLOWDOWN, cause=Cause.COMPUTE, rank=4,
        gpu=4, node="node-0", onset_step=12, onset_ns=0, detected_ns=0, severity=0.12,
        summary="slowdown: rank 4 (GPU 4) on node-0",
    )  # fmt: skip
    return Verdict(**{**base, **fields})  # type: ignore[arg-type]


def test_revisions_that_only_move_figures_a_little_print_nothing() -> None:
    """17 revisions of one incident whose evidence and cost wobble within a few points
    (what a noisy job makes) are one line; a new culprit, a jump in cost and the
    resolution are a line each."""
    log = IncidentLog()
    first = _incident()
    stream = [first]
    for i in range(17):
        stream.append(
            msgspec.structs.replace(
                first,
                revision=i + 1,
                status=VerdictStatus.UPDATE,
                severity=0.12 + (0.03 if i % 2 else -0.02),
                evidence={"step_time_ratio": 1.2 + i / 100},
                detected_ns=i,
            )
        )
    moved = msgspec.structs.replace(stream[-1], revision=18, rank=5, gpu=5)
    jumped = msgspec.structs.replace(moved, revision=19, severity=0.35)
    done = msgspec.structs.replace(jumped, revision=20, status=VerdictStatus.RESOLVED)
    lines = log.updates([*stream, moved, jumped, done])
    assert [ln.split("]")[0] + "]" for ln in lines] == [
        "[open    ]",
        "[update  ]",
        "[update  ]",
        "[resolved]",
    ]
    assert "culprit was rank 4 (GPU 4) on node-0" in lines[1]
    assert "cost 10% -> 35% (level warning -> critical)" in lines[2]  # from the last line
    assert "since step 12, cost 35%" in lines[3]


def test_the_summary_leaves_out_what_is_unknown() -> None:
    log = IncidentLog()
    log.update(_incident(rank=None, gpu=None, node=None, onset_step=None, severity=0.0,
                         cause=Cause.UNKNOWN, phase=Phase.FORWARD))  # fmt: skip
    log.update(_incident(verdict_id="h", kind=VerdictKind.HANG, severity=1.0, onset_ns=5))
    table = log.summary()
    assert table[0] == "2 incidents:"
    assert "None" not in "\n".join(table)
    unloc, hang = table[2], table[3]
    assert unloc.split() == ["slowdown", "unlocalised", "open"]
    assert hang.split()[-2:] == ["all", "open"]


def test_a_resumed_log_does_not_tell_again_what_it_told() -> None:
    import pickle

    log = IncidentLog()
    log.update(_incident())
    again = pickle.loads(pickle.dumps(log))
    assert again.update(msgspec.structs.replace(_incident(), revision=1, severity=0.13)) is None
