"""``megatrace bench``'s measures that can go wrong quietly: what they count and leave."""

from __future__ import annotations

from typing import Any

import pytest

from infra.stack import Stack
from megatrace.bench import _engine_alone
from producers.sim.scenarios import build
from schemas.codec import encode
from schemas.config import Settings
from schemas.tables import TABLE_FOR


def _raw_rows(n: int) -> dict[str, list[bytes]]:
    rows: dict[str, list[bytes]] = {}
    for rec in list(build("healthy", scale="tiny", seed=0, steps=2).records())[:n]:
        rows.setdefault(TABLE_FOR[type(rec)].name, []).append(encode(rec))
    return rows


def test_clickhouse_alone_parses_the_rows_and_leaves_no_database(
    settings: Settings, ch: Any
) -> None:
    rows = _raw_rows(3000)
    assert len(rows) >= 3  # several raw tables, each inserted into its Null copy
    before = {r[0] for r in ch.query("SELECT name FROM system.databases").result_rows}
    rate, cpu, start = _engine_alone(settings, Stack(settings), settings.clickhouse.database, rows)
    assert rate > 0 and cpu.flow + cpu.rest > 0 and start == 0.0
    after = {r[0] for r in ch.query("SELECT name FROM system.databases").result_rows}
    assert after == before


def test_clickhouse_alone_really_parses_a_row_it_is_given(settings: Settings) -> None:
    # a Null table throws rows away, but only once parsed: a row ClickHouse refuses fails
    rows = {"heartbeats": [b'{"type":"hb","v":1,"job":"j","node":"n","rank":"x"}']}
    with pytest.raises(Exception, match="rank"):
        _engine_alone(settings, Stack(settings), settings.clickhouse.database, rows)


@pytest.mark.integration
def test_bench_pipeline_stops_the_broker_it_started(tmp_path) -> None:
    """A bounded command leaves no process behind (the demo's stack, which stays up on
    purpose, says so)."""
    import subprocess
    import sys

    state = ["--state-dir", str(tmp_path / "state")]
    run = [sys.executable, "-m", "megatrace", *state]
    res = subprocess.run(
        [*run, "bench", "pipeline", "--steps", "1", "--scale", "tiny", "--seconds", "1",
         "--rate", "2000", "--repeat", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert "records through the paced run" in res.stdout
    status = subprocess.run([*run, "stack", "status"], capture_output=True, text=True, timeout=60)
    assert "broker: not running" in status.stdout, status.stdout


def test_bench_analyze_times_every_stage_of_the_route_and_counts_what_reaches_the_job() -> None:
    """The detector cost is measured through the route the flow runs (every stage timed by
    its hook), so that a stage left out, or work done twice, shows in the table."""
    import re

    from megatrace.bench_units import analyze

    lines: list[str] = []
    analyze("tiny", 8, lines.append, poll=500)
    text = "\n".join(lines)
    head = re.match(r"tiny: 8 ranks, ([\d,]+) records per step, (\d+) communicators; .* "
                    r"is called ([\d,]+) times a step", text)  # fmt: skip
    assert head is not None, text
    assert int(head[2]) >= 4 and int(head[3].replace(",", "")) > 0
    cost = {
        m[1]: float(m[2]) for m in re.finditer(r"  (per \w+|timers)\b.*?([\d.]+) ms/step", text)
    }
    assert set(cost) == {"per communicator", "per shard", "per node", "per job", "timers"}, text
    assert cost["per communicator"] > 0 and cost["per job"] > 0
    assert re.search(r"closed a step .* ([\d.]+) ms median", text), text
