"""A healthy soak of the lab's real jobs, kept: DDP, sharded data parallelism and a custom
loop, 2,500 steps each (`megatrace lab --case ddp-healthy --case zero-healthy --case
custom-healthy --steps 2500`), in ``tests/corpus/soak/run1``. Their steps take about
20 ms on a 2-core machine shared with the broker, the flow and ClickHouse, and the
host's own hiccups slow a rank or the whole job for up to half a second now and then:
25 steps of a job this fast, as many as a fault makes. What the detectors say of them is
scored here as ``megatrace eval --corpus tests/corpus/soak/run1 --no-simulator`` scores
it: no slowdown and no degraded link (each lasted under the second a shift must last);
the single slow steps of a rank or a host, 1.6-3.1x, are real stragglers and told as
transient ones, no more of them than now."""

from __future__ import annotations

from pathlib import Path

import pytest

from detectors.scoring import Score
from megatrace.evaluate import Results, corpus, score

SOAK = Path(__file__).parent / "corpus" / "soak" / "run1"


@pytest.fixture(scope="module")
def scored() -> Score:
    res = Results()
    res.add(score(corpus(SOAK), baselines=False, progress=lambda _: None))
    assert res.cases == 3
    return res.scores["megatrace"]


def test_a_healthy_soak_has_no_slowdown_and_no_degraded_link(scored: Score) -> None:
    assert scored.healthy_steps == 7500
    for kind in ("slowdown", "link_degradation", "hang"):
        assert kind not in scored.kinds or scored.kinds[kind].fp == 0, kind


def test_a_healthy_soaks_single_slow_steps_are_no_more_alarms_than_now(scored: Score) -> None:
    assert scored.healthy_alarms <= 7
