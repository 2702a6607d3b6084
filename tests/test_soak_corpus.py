"""A healthy soak of the lab's real jobs, kept: DDP, sharded data parallelism and a custom
loop, 2,500 steps each (`megatrace lab --case ddp-healthy --case zero-healthy --case
custom-healthy --steps 2500`), in ``tests/corpus/soak/run1``. Their steps take about
20 ms on a 2-core machine shared with the broker, the flow and ClickHouse, and the
host's own hiccups slow a rank or the whole job for up to half a second now and then:
25 steps of a job this fast, as many as a fault makes; and the scheduler keeps a rank
waiting a few of its time slices, a single step 1.6-3.1x slower (20-40 ms lost). What
the detectors say of them is scored here as ``megatrace eval --corpus
tests/corpus/soak/run1 --no-simulator`` scores it: nothing (each spell lasted under the
second a shift must last, each single slow step cost under the 50 ms a straggler must
cost; before either rule, 3 slowdowns, 2 degraded links, 6 transient stragglers and an
intermittent slowdown)."""

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


def test_a_healthy_soaks_single_slow_steps_are_no_stragglers(scored: Score) -> None:
    assert scored.healthy_alarms == 0
