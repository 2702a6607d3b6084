"""Every Grafana panel's SQL, run on the embedded engine against a simulated faulty job.

The job is the demo's story (a degraded link from step 7, a slow GPU on rank 15
from step 18, rank 5 never posting a Recv at step 32), analysed by the
detectors and stored as the flow stores it. Variables and macros are expanded
as Grafana and the ClickHouse plugin would.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.grafana.dashboards import DASHBOARDS, FLEET, JOB, LINKS, dashboard_path
from infra.grafana.model import ALL, DATASOURCE, expand, render

pytestmark = pytest.mark.integration
GRAFANA = Path(__file__).parent.parent / "infra" / "grafana"


def rows(ch: Any, story: dict[str, Any], sql: str, **variables: Any) -> list[dict[str, Any]]:
    values = {"job": story["job"], "node": ALL, "rank": ALL, **variables}
    result = ch.query(expand(sql, values, story["range"], database=story["db"]))
    return [dict(zip(result.column_names, r, strict=True)) for r in result.result_rows]


def panel(ch: Any, story: dict[str, Any], dash: Any, key: str, **v: Any) -> list[dict[str, Any]]:
    return rows(ch, story, dash.panel(key).sql, **v)


def test_committed_dashboards_are_what_the_module_builds() -> None:
    for d in DASHBOARDS:
        path = dashboard_path(d)
        assert path.read_text() == render(d), f"run python -m infra.grafana.dashboards ({path})"
        model = json.loads(path.read_text())
        assert {p["targets"][0]["rawSql"] for p in model["panels"]} == {p.sql for p in d.panels}


def test_provisioning_points_at_the_dashboards_and_the_plugin() -> None:
    ds = yaml.safe_load((GRAFANA / "provisioning/datasources/clickhouse.yaml").read_text())
    (source,) = ds["datasources"]
    assert source["type"] == "grafana-clickhouse-datasource"
    assert source["uid"] == DATASOURCE["uid"]
    prov = yaml.safe_load((GRAFANA / "provisioning/dashboards/megatrace.yaml").read_text())
    assert prov["providers"][0]["type"] == "file"


def test_every_panel_variable_and_annotation_runs_and_returns_rows(ch: Any, story: dict) -> None:
    for d in DASHBOARDS:
        for p in d.panels:
            assert rows(ch, story, p.sql), f"{d.uid}/{p.key} returned nothing"
        for v in d.variables:
            assert rows(ch, story, v.sql), f"{d.uid} variable {v.name} returned nothing"
        for name, sql in d.annotations:
            assert len(rows(ch, story, sql)) == 3, f"{d.uid} annotation {name}"


def test_fleet_overview_shows_the_hung_job_first(ch: Any, story: dict) -> None:
    (job,) = panel(ch, story, FLEET, "jobs")
    assert (job["job"], job["health"], job["open_incidents"]) == (story["job"], "hung", 3)
    assert "rank 5" in job["worst_summary"]
    assert panel(ch, story, FLEET, "open_hangs") == [{"hung": 1}]
    top = panel(ch, story, FLEET, "top_nodes")
    assert top[0]["node"] == "node-1" and set(top[0]["kinds"]) == {"hang", "link_degradation"}
    assert sum(r["verdicts"] for r in panel(ch, story, FLEET, "verdicts_over_time")) == 3


def test_job_drill_down_names_every_culprit(ch: Any, story: dict) -> None:
    verdicts = {r["kind"]: r for r in panel(ch, story, JOB, "verdicts")}
    assert verdicts["hang"]["rank"] == 5 and verdicts["hang"]["microbatch"] == 3
    assert verdicts["slowdown"]["rank"] == 15
    assert verdicts["link_degradation"]["link"] == "node-1/mlx5_2->node-2/mlx5_2"
    steps = panel(ch, story, JOB, "step_time")
    assert max(r["step_ms"] for r in steps) > 1.3 * min(r["step_ms"] for r in steps)
    # the hung step, and only it, is drawn apart: closed without its missing collectives
    (incomplete,) = [r for r in steps if r["incomplete_step_ms"] is not None]
    assert incomplete["incomplete_step_ms"] == incomplete["step_ms"]
    assert incomplete["time"] == max(r["time"] for r in steps)
    # the heat map: during the slow-GPU fault, rank 15 is the hottest row
    cells = [r for r in panel(ch, story, JOB, "lateness_heatmap") if 18 <= r["step"] <= 31]
    by_rank: dict[int, list[float]] = {}
    for c in cells:
        by_rank.setdefault(c["rank"], []).append(c["lateness_ms"])
    assert max(by_rank, key=lambda r: sum(by_rank[r]) / len(by_rank[r])) == 15
    assert panel(ch, story, JOB, "blame")[0]["rank"] == 15
    path = panel(ch, story, JOB, "critical_path")
    assert [r["position"] for r in path] == list(range(1, len(path) + 1))
    assert path[0]["node"] == "F0s0" and path[-1]["node"] == "B7s0"


def test_alignment_panel_counts_what_did_not_meet(ch: Any, story: dict) -> None:
    """Nothing was sent twice or out of order; the hang left collectives that never
    completed (reported partial) on the communicators that stopped, rank 5's among them."""
    table = panel(ch, story, JOB, "alignment")
    assert len(table) == 20 and all(r["records"] > 0 and r["role"] for r in table)
    assert all(r["late"] == r["out_of_order"] == r["dropped"] == 0 for r in table)
    stopped = [r for r in table if r["partial"] > 0]
    assert stopped == table[: len(stopped)] and any(5 in r["ranks"] for r in stopped)
    assert all(r["open_now"] >= 1 for r in stopped)


def test_variables_filter_the_panels(ch: Any, story: dict) -> None:
    only = panel(ch, story, JOB, "lateness_heatmap", rank=["5", "15"])
    assert {r["rank"] for r in only} == {5, 15}
    on_node = panel(ch, story, JOB, "blame", node=["node-3"])
    assert {r["node"] for r in on_node} == {"node-3"}
    assert panel(ch, story, JOB, "verdicts", job="no-such-job") == []


def test_links_view_puts_the_degraded_link_on_top(ch: Any, story: dict) -> None:
    worst = panel(ch, story, LINKS, "slowest_links")[0]
    assert worst["link"] == "node-1/mlx5_2->node-2/mlx5_2" and worst["drop"] > 0.5
    (v,) = panel(ch, story, LINKS, "link_verdicts")
    assert (v["src_rank"], v["dst_rank"]) == (6, 10)
    edge = panel(ch, story, LINKS, "proxy_waits")[0]
    assert (edge["rank"], edge["peer"], edge["direction"]) == (6, 10, "send")
    series = panel(ch, story, LINKS, "link_throughput", node=["node-1"])
    assert {r["link"].split("/")[0] for r in series} == {"node-1"}


def test_cpu_wait_panel_gives_each_rank_its_share_between_heartbeats(ch: Any, story: dict) -> None:
    """The story's hosts are healthy: the simulator's ranks wait for a CPU 0.01-0.23 s a
    second. Each rank's first heartbeat has nothing before it and is left out (a share
    from zero would be the counter over the process's whole life)."""
    series = panel(ch, story, JOB, "cpu_wait")
    by_rank: dict[str, list[float]] = {}
    for r in series:
        by_rank.setdefault(r["rank"], []).append(r["cpu_wait_s_per_s"])
    assert len(by_rank) == 16
    assert all(0.005 < x < 0.25 for xs in by_rank.values() for x in xs)
    assert {r["rank"] for r in panel(ch, story, JOB, "cpu_wait", rank=["5"])} == {"5"}


def _cpu_panel(ch: Any, name: str, beats: list[Any]) -> list[dict[str, Any]]:
    """The job dashboard's CPU panel over ``beats`` (one job's heartbeats, from now on),
    stored in a database of their own."""
    import time

    from infra.clickhouse import init_db, insert_records

    db = f"{name}_{time.time_ns() % 10**9}"
    init_db(ch, db, retention_days=0)
    insert_records(ch, db, beats)
    now = beats[0].ts_ns // 10**9
    return panel(ch, {"db": db, "job": beats[0].job, "range": (now - 60, now + 60)}, JOB,
                 "cpu_wait")  # fmt: skip


def _by_rank(rows: list[dict[str, Any]], column: str) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for r in rows:
        out.setdefault(r["rank"], []).append(r[column])
    return out


def test_cpu_wait_panel_shows_the_quota_throttling_where_heartbeats_carry_it(ch: Any) -> None:
    """Rank 0's cgroup throttled 0.3 s a second from its third heartbeat; rank 1's source
    reads no throttled time (its series stays empty, not 0); rank 0's counter restarting
    in another cgroup adds nothing."""
    import time

    from schemas.records import Heartbeat

    t0 = time.time_ns()
    held = [0, 0, 0.3, 0.6, 0.9, 0.1]  # s throttled so far; the last after a move
    beats = [
        Heartbeat(job="quota-job", node="n0", rank=r, ts_ns=t0 + i * 10**9, cpu_ns=i * 10**9,
                  cpu_wait_ns=i * 10**8, cpu_throttled_ns=int(h * 1e9) if r == 0 else None)
        for i, h in enumerate(held) for r in (0, 1)
    ]  # fmt: skip
    got = _cpu_panel(ch, "throttle", beats)
    by_rank = _by_rank(got, "cpu_throttled_s_per_s")
    assert by_rank["0"] == pytest.approx([0.0, 0.3, 0.3, 0.3, 0.0])
    assert by_rank["1"] == [None] * 5
    assert all(r["cpu_wait_s_per_s"] == pytest.approx(0.1) for r in got)


def test_cpu_wait_panel_shows_the_time_ranks_spent_saving_checkpoints(ch: Any) -> None:
    """Rank 0 saves for 0.4 s of its third second; its process then starts again (the
    job restarted), its count from 0, and saves 0.2 s in the first second of that. Rank
    1 never saves; rank 2's source sees no saves: no series."""
    import time

    from schemas.records import Heartbeat

    t0 = time.time_ns()
    saved = [0, 0, 0.4, 0.4, 0.2]  # s saved so far; the last after the restart
    beats = [
        Heartbeat(job="saving-job", node="n0", rank=r, ts_ns=t0 + i * 10**9, cpu_ns=i * 10**9,
                  cpu_wait_ns=0, save_ns=(int(s * 1e9) if r == 0 else 0) if r < 2 else None)
        for i, s in enumerate(saved) for r in (0, 1, 2)
    ]  # fmt: skip
    by_rank = _by_rank(_cpu_panel(ch, "saves", beats), "saving_s_per_s")
    assert by_rank["0"] == pytest.approx([0.0, 0.4, 0.0, 0.2])
    assert by_rank["1"] == pytest.approx([0.0] * 4)
    assert by_rank["2"] == [None] * 4
