"""Records as ClickHouse RowBinary: the compiled encoder writes what the Python
reference writes, and the real embedded engine stores from it exactly the rows it
stores from the records' JSON; a record it cannot encode is a clear error."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest

from infra import rowbinary
from infra.clickhouse import init_db, insert_json, insert_rows
from producers.sim.scenarios import build
from schemas.codec import encode
from schemas.records import CommProgress, DeadLetter, Heartbeat, Kernel
from schemas.results import Verdict
from schemas.tables import TABLE_FOR, TABLES
from tests.examples import every_record

compiled = pytest.mark.skipif(
    rowbinary._native is None, reason="the compiled encoder was not built (no C compiler)"
)


def _minimal(rec: msgspec.Struct) -> msgspec.Struct:
    """``rec`` with every optional field at its default (None, empty, 0)."""
    fields = msgspec.structs.fields(rec)
    required = {f.name: getattr(rec, f.name) for f in fields if f.required}
    return type(rec)(**required)


def _unusual() -> list[msgspec.Struct]:
    """Values at the edges of their columns: the largest comm hash, negative and huge
    integers, non-ASCII and empty strings, a map and nested tuples."""
    by_type = {type(r): r for r in every_record()}
    hb, kernel, verdict = by_type[Heartbeat], by_type[Kernel], by_type[Verdict]
    return [
        msgspec.structs.replace(
            hb,
            comms=[
                CommProgress(comm_hash=2**64 - 1, issued_seq=-1, completed_seq=2**63 - 1),
                CommProgress(comm_hash=0),
            ],
        ),
        msgspec.structs.replace(kernel, name="ncclKernel_AllReduce_ü€😀", node="", comm_hash=1),
        msgspec.structs.replace(
            verdict, evidence={"ratio": 1.25, "": -0.0, "tiny": 5e-324}, summary="Grüße"
        ),
    ]


def _samples() -> list[msgspec.Struct]:
    recs = list(build("story", scale="tiny", seed=0, steps=3, now=True).records())
    full = every_record()
    return [*full, *map(_minimal, full), *_unusual(), *recs[:3000]]


def _by_table(records: list[msgspec.Struct]) -> dict[str, list[msgspec.Struct]]:
    out: dict[str, list[msgspec.Struct]] = {}
    for r in records:
        out.setdefault(TABLE_FOR[type(r)].name, []).append(r)
    return out


@compiled
def test_the_compiled_encoder_writes_what_the_reference_writes_byte_for_byte() -> None:
    tables = _by_table(_samples())
    assert set(tables) == set(TABLES)  # every table's record type is among the samples
    for name, records in tables.items():
        plan = rowbinary.plan_for(name)
        if name == "dead_letters":
            assert plan is None  # bytes fields: JSON writes them as base64, so JSON only
            continue
        assert plan is not None
        assert rowbinary._native.encode(plan.struct, records) == rowbinary.encode_py(
            plan, records
        ), name


def _table_contents(ch: Any, database: str, table: str) -> list[tuple[Any, ...]]:
    t = TABLES[table]
    rows = ch.query(
        f"SELECT {t.select_list()}, {', '.join(t.time_columns)} FROM {database}.{table} FINAL "
        f"ORDER BY {', '.join(t.order_by)}"
    ).result_rows
    return [tuple(repr(v) for v in row) for row in rows]  # repr: -0.0 is not 0.0


@pytest.mark.integration
def test_clickhouse_stores_the_same_rows_from_rowbinary_as_from_json(ch: Any) -> None:
    import time

    json_db, binary_db = (f"rb_{k}_{time.time_ns() % 10**9}" for k in ("json", "bin"))
    for db in (json_db, binary_db):
        init_db(ch, db, retention_days=0)
    tables = _by_table(_samples())
    for name, records in tables.items():
        insert_json(ch, json_db, name, [encode(r) for r in records])
        assert insert_rows(ch, binary_db, name, records) == len(records)
    for name in tables:
        got = _table_contents(ch, binary_db, name)
        assert got == _table_contents(ch, json_db, name), name
        assert len(got) > 0
    for db in (json_db, binary_db):
        ch.command(f"DROP DATABASE {db} SYNC")


@pytest.mark.integration
def test_rowbinary_keeps_a_nan_that_json_cannot_spell(ch: Any, database: str) -> None:
    """JSON writes NaN as null, which ClickHouse reads as 0; RowBinary keeps it."""
    verdict = next(r for r in every_record() if isinstance(r, Verdict))
    insert_rows(
        ch, database, "verdicts", [msgspec.structs.replace(verdict, evidence={"x": math.nan})]
    )
    (got,) = ch.query(f"SELECT evidence['x'] FROM {database}.verdicts").result_rows[0]
    expected_nan = rowbinary.plan_for("verdicts") is not None
    assert math.isnan(got) if expected_nan else got == 0


@pytest.mark.integration
def test_a_list_mixing_json_and_records_is_stored_whole(ch: Any, database: str) -> None:
    """Rows a snapshot kept as JSON, joined by records after an upgrade."""
    hb = next(r for r in every_record() if isinstance(r, Heartbeat))
    rows = [encode(msgspec.structs.replace(hb, ts_ns=1)), msgspec.structs.replace(hb, ts_ns=2)]
    assert insert_rows(ch, database, "heartbeats", rows) == 2
    later = [msgspec.structs.replace(hb, ts_ns=3), encode(msgspec.structs.replace(hb, ts_ns=4))]
    assert insert_rows(ch, database, "heartbeats", later) == 2  # a record first, then JSON
    got = ch.query(f"SELECT ts_ns FROM {database}.heartbeats ORDER BY ts_ns").result_rows
    assert got == [(1,), (2,), (3,), (4,)]


@compiled
def test_a_record_of_another_type_is_a_clear_error() -> None:
    hb = next(r for r in every_record() if isinstance(r, Heartbeat))
    plan = rowbinary.plan_for("kernel_events")
    assert plan is not None
    with pytest.raises(TypeError, match="encodes Kernel records, not Heartbeat"):
        rowbinary.encode(plan, [hb])


@compiled
@pytest.mark.parametrize(
    ("field", "value", "error", "message"),
    [
        ("rank", "3", TypeError, r"Kernel\.rank: .*Int64 column: cannot encode a str"),
        ("comm_hash", -1, OverflowError, r"Kernel\.comm_hash: "),
        ("comm_hash", 2**64, OverflowError, r"Kernel\.comm_hash: "),
        ("start_ns", 2**63, OverflowError, r"Kernel\.start_ns: "),
        ("name", b"x", TypeError, r"Kernel\.name: .*String column: cannot encode a bytes"),
    ],
)
def test_a_value_outside_its_column_names_the_field(
    field: str, value: object, error: type[Exception], message: str
) -> None:
    """Records are validated when decoded; one built past validation still fails clearly,
    in both encoders, rather than writing a wrong row."""
    kernel = next(r for r in every_record() if isinstance(r, Kernel))
    bad = msgspec.structs.replace(kernel)
    msgspec.structs.force_setattr(bad, field, value)
    plan = rowbinary.plan_for("kernel_events")
    assert plan is not None
    with pytest.raises(error, match=message):
        rowbinary.encode(plan, [kernel, bad])
    with pytest.raises((TypeError, OverflowError)):
        rowbinary.encode_py(plan, [bad])


@compiled
def test_a_malformed_plan_is_refused_before_anything_is_read() -> None:
    kernel = next(r for r in every_record() if isinstance(r, Kernel))
    plan = rowbinary.plan_for("kernel_events")
    assert plan is not None
    record, fields = plan.struct
    for broken in [
        (record, ((fields[0][0], 99),)),  # no such code
        (record, ((fields[0][0], (rowbinary.NULLABLE,)),)),  # a code without its argument
        (record, (("rank", rowbinary.INT64),)),  # not a member descriptor
        (Heartbeat, ((fields[0][0], rowbinary.INT64), (Kernel.__dict__["name"], 5))),
        (record,),
    ]:
        with pytest.raises(ValueError):
            rowbinary._native.encode(broken, [kernel])


def test_a_record_with_bytes_has_no_plan_and_goes_as_json() -> None:
    assert "raw" in DeadLetter.__struct_fields__
    with pytest.raises(TypeError, match="bytes field"):
        rowbinary.Plan.of(TABLES["dead_letters"])
    assert rowbinary.plan_for("dead_letters") is None


@pytest.mark.parametrize("encoder_built", [True, False])
def test_a_poll_goes_to_its_tables_as_records_or_as_their_json(
    monkeypatch: pytest.MonkeyPatch, encoder_built: bool
) -> None:
    """The comm topic holds two kinds: each goes to its table, in order, as the records
    (written as RowBinary) or, where the encoder was not built, as the JSON read."""
    import flows.decode
    from flows.decode import Decoded, rows_of
    from schemas.records import Collective, ProxySummary

    by_type = {type(r): r for r in every_record()}
    coll, proxy = by_type[Collective], by_type[ProxySummary]
    recs = [coll, proxy, msgspec.structs.replace(coll, seq=coll.seq + 1)]
    raws = [encode(r) for r in recs]
    if not encoder_built:
        monkeypatch.setattr(flows.decode, "plan_for", lambda table: None)
    elif rowbinary._native is None:
        pytest.skip("the compiled encoder was not built (no C compiler)")
    d = Decoded(recs, raws, [], 7, frozenset(map(type, recs)), "0-megatrace.comm")
    part, (rows, produced_ms) = rows_of(d)
    want = recs if encoder_built else raws
    assert (part, produced_ms) == ("0-megatrace.comm", 7)
    assert rows == {"collective_events": [want[0], want[2]], "proxy_events": [want[1]]}


@compiled
@pytest.mark.integration
def test_a_record_that_cannot_be_written_is_refused_by_name_not_sent_as_json(
    ch: Any, database: str
) -> None:
    kernel = next(r for r in every_record() if isinstance(r, Kernel))
    bad = msgspec.structs.replace(kernel)
    msgspec.structs.force_setattr(bad, "rank", "3")
    with pytest.raises(TypeError, match=r"Kernel\.rank"):
        insert_rows(ch, database, "kernel_events", [kernel, bad])
    assert ch.query(f"SELECT count() FROM {database}.kernel_events").result_rows == [(0,)]
