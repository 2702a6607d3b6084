"""The flow's own rows reach ClickHouse in few, large inserts, and nothing held is lost."""

from __future__ import annotations

import pickle
import time
from datetime import UTC, datetime, timedelta

import pytest

from flows.state import RowBatchLogic
from schemas.config import ConfigError, load_settings


def test_rows_are_gathered_until_enough_and_keep_the_oldest_producer_time() -> None:
    logic = RowBatchLogic(max_rows=3, max_ms=60_000, resume=None)
    assert logic.on_batch([([b"a", b"b"], 50)])[0] == []
    assert logic.notify_at() is not None  # something is held: a timer is due
    out, _ = logic.on_batch([([b"c"], 30), ([b"d"], 0)])
    assert out == [([b"a", b"b", b"c", b"d"], 30)]
    assert logic.notify_at() is None


def test_held_rows_go_when_the_oldest_waited_long_enough() -> None:
    logic = RowBatchLogic(max_rows=1000, max_ms=50, resume=None)
    before = datetime.now(UTC)
    logic.on_batch([([b"a"], 0)])
    due = logic.notify_at()
    assert due is not None and before + timedelta(milliseconds=50) <= due
    time.sleep(0.06)
    assert logic.on_notify()[0] == [([b"a"], 0)]
    assert logic.on_notify()[0] == []


def test_held_rows_survive_a_restart_from_the_snapshot_and_the_end_of_input() -> None:
    logic = RowBatchLogic(max_rows=1000, max_ms=60_000, resume=None)
    logic.on_batch([([b"a", b"b"], 7)])
    resumed = RowBatchLogic(1000, 60_000, pickle.loads(pickle.dumps(logic.snapshot())))
    assert resumed.notify_at() is not None
    assert resumed.on_eof()[0] == [([b"a", b"b"], 7)]


@pytest.mark.parametrize("bad", ["batch_rows", "batch_ms", "raw_batch_ms"])
def test_batch_settings_are_validated(bad: str) -> None:
    with pytest.raises(ConfigError, match="raw_batch_ms must be at least 1, not"):
        load_settings(overrides={"clickhouse": {bad: 0}})
