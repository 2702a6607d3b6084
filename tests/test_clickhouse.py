"""Tables on the real embedded ClickHouse engine: exact round trips and idempotent replay."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from infra.clickhouse import (
    ClickHouseError,
    connect,
    init_db,
    insert_json,
    insert_records,
    read_records,
)
from schemas.enums import VerdictStatus
from schemas.results import StepSummary, Verdict
from schemas.tables import TABLE_FOR, TABLES
from schemas.views import VIEWS
from tests.examples import every_record

pytestmark = pytest.mark.integration


def test_every_record_round_trips_field_for_field(ch: Any, database: str) -> None:
    records = every_record()
    assert insert_records(ch, database, records) == len(records)
    for rec in records:
        (back,) = list(read_records(ch, database, TABLE_FOR[type(rec)].name))
        assert back == rec


def test_init_is_idempotent_and_creates_every_table(ch: Any, database: str) -> None:
    init_db(ch, database, retention_days=0)
    names = {r[0] for r in ch.query(f"SHOW TABLES FROM {database}").result_rows}
    assert names == set(TABLES) | {v.name for v in VIEWS}


def test_replay_does_not_duplicate_rows(ch: Any, database: str) -> None:
    records = every_record()
    insert_records(ch, database, records)
    insert_records(ch, database, records)  # an at-least-once restart replays
    for table in TABLES.values():
        assert len(list(read_records(ch, database, table.name))) == 1, table.name


def test_latest_verdict_revision_wins(ch: Any, database: str) -> None:
    v = next(r for r in every_record() if isinstance(r, Verdict))
    resolved = msgspec.structs.replace(v, revision=v.revision + 1, status=VerdictStatus.RESOLVED)
    insert_records(ch, database, [resolved])
    insert_records(ch, database, [v])  # an older revision replayed later
    (back,) = list(read_records(ch, database, "verdicts"))
    assert back.status == VerdictStatus.RESOLVED


def test_retention_ttl_is_in_the_ddl(ch: Any, database: str) -> None:
    init_db(ch, database + "_ttl", retention_days=3)
    ddl = ch.command(f"SHOW CREATE TABLE {database}_ttl.verdicts")
    assert "TTL toDateTime(detected) + toIntervalDay(3)" in ddl
    assert "MATERIALIZED fromUnixTimestamp64Nano(detected_ns" in ddl


def test_second_embedded_directory_is_a_clear_error(ch: Any, tmp_path) -> None:
    with pytest.raises(ClickHouseError, match="one data directory per process"):
        connect(f"chdb://{tmp_path}/other")


def test_unknown_url_scheme_is_a_clear_error() -> None:
    with pytest.raises(ClickHouseError, match="unsupported ClickHouse URL scheme 'ftp'"):
        connect("ftp://x")


def test_a_table_with_an_old_schema_is_a_clear_error(ch: Any, database: str) -> None:
    ch.command(f"DROP TABLE {database}.heartbeats")
    ch.command(
        f"CREATE TABLE {database}.heartbeats (job String, ts_ns DateTime64(9)) "
        "ENGINE = MergeTree ORDER BY job"
    )
    with pytest.raises(ClickHouseError, match="heartbeats exists with a different schema"):
        init_db(ch, database, retention_days=0)


def test_a_table_with_an_old_key_is_a_clear_error(ch: Any, database: str) -> None:
    """Same columns, another key: rows this version keeps apart would replace each other."""
    from schemas.tables import TABLES

    t = TABLES["collectives"]
    ch.command(f"DROP TABLE {database}.collectives")
    ddl = t.ddl(database, 0).replace(", receiver)", ")")
    assert "ORDER BY (job, comm_hash, seq, sender)" in ddl
    ch.command(ddl)
    with pytest.raises(ClickHouseError, match="collectives exists with another key"):
        init_db(ch, database, retention_days=0)


def test_a_table_from_before_columns_were_added_gets_them_and_keeps_its_rows(
    ch: Any, database: str
) -> None:
    """An upgrade: the steps table as megatrace made it before it counted instances."""
    added = ("instances", "expected_instances", "late_instances")
    ddl = TABLES["steps"].ddl(database, 0).replace(", left_out Bool", "")
    for name in added:
        ddl = ddl.replace(f", {name} Int64", "")
    assert "instances" not in ddl and "left_out" not in ddl
    ch.command(f"DROP TABLE {database}.steps")
    ch.command(ddl)
    old = b'{"type":"step","v":1,"job":"j","step":0,"start_ns":1,"end_ns":5,"duration_ns":4}'
    insert_json(ch, database, "steps", [old])
    init_db(ch, database, retention_days=0)
    init_db(ch, database, retention_days=0)  # and again: nothing more to add
    new = StepSummary(job="j", step=1, start_ns=5, end_ns=9, duration_ns=4, instances=7,
                      expected_instances=8, left_out=True)  # fmt: skip
    insert_records(ch, database, [new])
    got = {s.step: s for s in read_records(ch, database, "steps")}
    assert (got[0].instances, got[0].expected_instances, got[0].duration_ns) == (0, 0, 4)
    assert not got[0].left_out
    assert got[1] == new
    names = [r[0] for r in ch.query(f"DESCRIBE TABLE {database}.steps").result_rows]
    assert names[: len(TABLES["steps"].column_names)] == TABLES["steps"].column_names


def test_the_command_lines_questions_count_what_is_stored(ch: Any, database: str) -> None:
    from infra.queries import align_account, dead_letter_counts, step_account
    from schemas.enums import DeadLetterReason as R
    from schemas.records import DeadLetter

    dead = [
        DeadLetter(ts_ns=i + 1, reason=r, error="e", raw=b"x%d" % i)
        for i, r in enumerate([R.MALFORMED, R.MALFORMED, R.OUT_OF_LAYOUT])
    ]
    steps = [
        StepSummary(
            job="j",
            step=s,
            start_ns=s * 10**8,
            end_ns=(s + 1) * 10**8,
            duration_ns=10**8 + s * 10**6,
            instances=9 if s else 7,
            expected_instances=9,
            late_instances=s,
            left_out=not s,
        )
        for s in range(3)
    ]
    insert_records(ch, database, [*dead, *steps])
    assert dead_letter_counts(ch, database) == [("malformed", 2), ("out_of_layout", 1)]
    assert step_account(ch, database, "j") == (3, 101.0, 1, 2)
    assert align_account(ch, database, "nobody") == (0, 0, 0, 0, 0)
