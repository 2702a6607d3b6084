"""Grafana dashboards over the ClickHouse query model, defined once here.

Each panel is a :class:`~infra.grafana.model.Panel` with its SQL written for the official ClickHouse
datasource plugin (``grafana-clickhouse-datasource``): Grafana's template
variables (``${job}``, ``${node}``, ``${rank}``) and the plugin's macros
(``$__timeFilter(col)``, ``$__timeInterval(col)``, ``$__interval_s``,
``$__conditionalAll(cond, $var)``). ``python -m infra.grafana.dashboards``
writes the JSON files under ``infra/grafana/dashboards/``, which provisioning
loads; a test keeps the files equal to what this module builds, and runs
every panel's SQL through :func:`~infra.grafana.model.expand` on the embedded engine.
The model, the JSON and the SQL expansion are :mod:`infra.grafana.model`'s.
"""

from __future__ import annotations

from pathlib import Path

from infra.grafana.model import DB, Dashboard, Panel, Variable, render

HERE = Path(__file__).parent


_JOB = Variable("job", f"SELECT DISTINCT job FROM {DB}.jobs FINAL ORDER BY job")
_NODE = Variable(
    "node",
    f"SELECT DISTINCT node FROM {DB}.ranks FINAL WHERE job = '${{job}}' ORDER BY node",
    multi=True,
    include_all=True,
)
_RANK = Variable(
    "rank",
    f"SELECT DISTINCT rank FROM {DB}.ranks FINAL WHERE job = '${{job}}' ORDER BY rank",
    multi=True,
    include_all=True,
)

FLEET = Dashboard(
    "megatrace-fleet",
    "megatrace - fleet overview",
    [
        Panel(
            "unhealthy_jobs",
            "Unhealthy jobs",
            "stat",
            f"SELECT countIf(health != 'healthy') AS unhealthy FROM {DB}.job_status",
            width=6,
            height=4,
        ),
        Panel(
            "open_hangs",
            "Hung jobs",
            "stat",
            f"SELECT countIf(health = 'hung') AS hung FROM {DB}.job_status",
            width=6,
            height=4,
        ),
        Panel(
            "lost_throughput",
            "Throughput lost now (sum over jobs)",
            "stat",
            f"SELECT round(sum(worst_severity), 2) AS lost FROM {DB}.job_status",
            width=12,
            height=4,
        ),
        Panel(
            "jobs",
            "Jobs now",
            "table",
            f"""SELECT job, health, open_incidents, round(worst_severity * 100, 1) AS lost_pct,
       ranks, last_step, last_heartbeat, worst_summary
FROM {DB}.job_status
ORDER BY health = 'healthy', worst_severity DESC, job""",
            width=24,
            description="One row per job: hung jobs first, then by throughput lost.",
        ),
        Panel(
            "open_incidents",
            "Open incidents in range",
            "table",
            f"""SELECT detected, job, kind, cause, node, rank, link,
       round(severity * 100, 1) AS lost_pct, round(confidence, 2) AS confidence, summary
FROM {DB}.verdicts FINAL
WHERE status != 'resolved' AND $__timeFilter(detected)
ORDER BY severity DESC, detected DESC
LIMIT 200""",
            width=24,
        ),
        Panel(
            "verdicts_over_time",
            "Verdicts by kind",
            "timeseries",
            f"""SELECT $__timeInterval(detected) AS time, kind, count() AS verdicts
FROM {DB}.verdicts FINAL
WHERE $__timeFilter(detected)
GROUP BY time, kind ORDER BY time""",
            format="timeseries",
        ),
        Panel(
            "top_nodes",
            "Top offending nodes (7 days)",
            "barchart",
            f"""SELECT node, count() AS incidents, round(sum(severity), 3) AS lost,
       groupUniqArray(kind) AS kinds
FROM {DB}.node_incidents FINAL
WHERE ts >= now() - INTERVAL 7 DAY
GROUP BY node ORDER BY lost DESC, incidents DESC LIMIT 20""",
            description="Nodes named as culprits by incidents of the last week.",
        ),
    ],
)

JOB = Dashboard(
    "megatrace-job",
    "megatrace - job drill-down",
    [
        Panel(
            "verdicts",
            "Verdicts",
            "table",
            f"""SELECT onset, detected, status, kind, cause, node, rank, gpu, link, onset_step,
       step, microbatch, phase, pp_stage, round(severity * 100, 1) AS lost_pct, summary
FROM {DB}.verdicts FINAL
WHERE job = '${{job}}' AND $__timeFilter(detected)
ORDER BY onset""",
            width=24,
        ),
        Panel(
            "step_time",
            "Step time (ms) and expected",
            "timeseries",
            f"""SELECT start AS time, duration_ns / 1e6 AS step_ms,
       expected_ns / 1e6 AS expected_ms,
       if(left_out, duration_ns / 1e6, NULL) AS incomplete_step_ms
FROM {DB}.steps FINAL
WHERE job = '${{job}}' AND $__timeFilter(start)
ORDER BY time""",
            format="timeseries",
            description="Change points and incidents show as annotations. incomplete_step_ms: "
            "a step the detectors left out: closed without some of its collectives (a hang, "
            "or records lost: its time covers only what came), or one that spans the job's "
            "restart or a checkpoint save.",
        ),
        Panel(
            "throughput",
            "Throughput vs expected",
            "timeseries",
            f"""SELECT start AS time, throughput_ratio
FROM {DB}.steps FINAL
WHERE job = '${{job}}' AND $__timeFilter(start) AND throughput_ratio IS NOT NULL
ORDER BY time""",
            format="timeseries",
        ),
        Panel(
            "lateness_heatmap",
            "Lateness heat map (rank x step, ms)",
            "heatmap",
            f"""SELECT step, rank, round(lateness_ns / 1e6, 3) AS lateness_ms
FROM {DB}.rank_steps FINAL
WHERE job = '${{job}}' AND $__timeFilter(start)
  AND $__conditionalAll(rank IN (${{rank}}), $rank)
  AND $__conditionalAll(node IN (${{node:singlequote}}), $node)
ORDER BY step, rank""",
            width=24,
            height=10,
            options={"calculate": False, "yAxis": {"axisLabel": "rank"}},
        ),
        Panel(
            "blame",
            "Blame by rank (time others waited on it)",
            "table",
            f"""SELECT rank, node, pp_stage,
       round(sum(blame_ns) / 1e6, 1) AS blame_ms, round(avg(lateness_ns) / 1e6, 3) AS lateness_ms
FROM {DB}.rank_steps FINAL
WHERE job = '${{job}}' AND $__timeFilter(start)
  AND $__conditionalAll(node IN (${{node:singlequote}}), $node)
GROUP BY rank, node, pp_stage ORDER BY blame_ms DESC LIMIT 20""",
        ),
        Panel(
            "critical_path",
            "Critical path of the slowest step",
            "table",
            f"""WITH worst AS (
  SELECT step, duration_ns, critical_path FROM {DB}.steps FINAL
  WHERE job = '${{job}}' AND $__timeFilter(start)
  ORDER BY duration_ns DESC LIMIT 1
)
SELECT step, round(duration_ns / 1e6, 1) AS step_ms, i AS position, critical_path[i] AS node
FROM worst ARRAY JOIN arrayEnumerate(critical_path) AS i
ORDER BY position""",
            description="Nodes are F|B<micro-batch>s<PP stage>, in schedule order.",
        ),
        Panel(
            "rank_wait",
            "Wait per rank and step (ms)",
            "timeseries",
            f"""SELECT start AS time, toString(rank) AS rank, wait_ns / 1e6 AS wait_ms
FROM {DB}.rank_steps FINAL
WHERE job = '${{job}}' AND $__timeFilter(start)
  AND $__conditionalAll(rank IN (${{rank}}), $rank)
ORDER BY time""",
            format="timeseries",
            width=24,
        ),
        Panel(
            "cpu_wait",
            "CPU wait, CPU quota throttling and checkpoint saving per rank (s a second)",
            "timeseries",
            f"""SELECT time, rank, cpu_wait_s_per_s, cpu_throttled_s_per_s, saving_s_per_s FROM (
  SELECT ts AS time, toString(rank) AS rank, lagInFrame(ts_ns) OVER w AS prev_ns,
         (cpu_wait_ns - lagInFrame(cpu_wait_ns) OVER w) / (ts_ns - prev_ns) AS cpu_wait_s_per_s,
         cpu_throttled_ns - lagInFrame(cpu_throttled_ns) OVER w AS held_ns,
         if(held_ns < 0, 0, held_ns) / (ts_ns - prev_ns) AS cpu_throttled_s_per_s,
         save_ns - lagInFrame(save_ns) OVER w AS saved_ns,
         if(saved_ns < 0, save_ns, saved_ns) / (ts_ns - prev_ns) AS saving_s_per_s
  FROM {DB}.heartbeats FINAL
  WHERE job = '${{job}}' AND $__timeFilter(ts) AND cpu_wait_ns IS NOT NULL
    AND $__conditionalAll(rank IN (${{rank}}), $rank)
  WINDOW w AS (PARTITION BY rank ORDER BY ts_ns ROWS BETWEEN 1 PRECEDING AND CURRENT ROW)
)
WHERE prev_ns > 0 AND time > fromUnixTimestamp64Nano(prev_ns, 'UTC') AND cpu_wait_s_per_s >= 0
ORDER BY time""",
            format="timeseries",
            width=24,
            description="How long each rank's threads were ready to run but waited for a CPU "
            "(a crowded host, a spent CPU quota), and how long its cgroups' CPU quota held it "
            "back (the kernel's throttled time, where the source reads it), from its "
            "heartbeats. A rank or host far above the rest since a slowdown began is "
            "starved of CPU: the slowdown's cause. Saving: the share of the time the rank "
            "spent saving checkpoints (where the PyTorch collector sees them), during "
            "which its peers wait for it.",
        ),
        Panel(
            "alignment",
            "Collectives that did not meet cleanly, per communicator",
            "table",
            f"""SELECT lower(hex(comm_hash)) AS comm, role, ranks, records,
       late_records AS late, out_of_order_records AS out_of_order,
       dropped_instances AS dropped, partial_reports AS partial, lost_instances AS lost,
       open_instances AS open_now
FROM {DB}.comm_accounts
WHERE job = '${{job}}' AND $__timeFilter(ts)
ORDER BY partial + late + out_of_order + dropped + lost DESC, records DESC
LIMIT 20""",
            width=24,
            description="Counted by the flow since its state began: late = a record for a "
            "collective already complete (a duplicate or replay), ignored; out_of_order = "
            "below a sequence number its rank already sent; dropped = evicted unfinished; "
            "partial = reported with members missing after the timeout (a hang shows here); "
            "lost = collectives the missing members went past (their records never arrived).",
        ),
    ],
    variables=[_JOB, _NODE, _RANK],
    annotations=[
        (
            "incidents",
            f"""SELECT onset AS time, detected AS timeEnd, concat(kind, ': ', summary) AS text
FROM {DB}.verdicts FINAL WHERE job = '${{job}}' AND $__timeFilter(onset)""",
        )
    ],
)

LINKS = Dashboard(
    "megatrace-links",
    "megatrace - links and NICs",
    [
        Panel(
            "link_throughput",
            "Throughput per link (Gb/s, per minute)",
            "timeseries",
            f"""SELECT ts AS time, link, avgMerge(avg_gbps) AS gbps
FROM {DB}.link_minutes
WHERE job = '${{job}}' AND $__timeFilter(ts)
  AND $__conditionalAll(splitByChar('/', link)[1] IN (${{node:singlequote}}), $node)
GROUP BY time, link ORDER BY time""",
            format="timeseries",
            width=24,
        ),
        Panel(
            "slowest_links",
            "Slowest links against their own best",
            "table",
            f"""SELECT link, src_rank, dst_rank, round(min(min_gbps), 1) AS worst_gbps,
       round(max(max_gbps), 1) AS best_gbps,
       round(1 - min(min_gbps) / nullIf(max(max_gbps), 0), 3) AS drop
FROM {DB}.link_minutes
WHERE job = '${{job}}' AND $__timeFilter(ts)
GROUP BY link, src_rank, dst_rank ORDER BY drop DESC LIMIT 20""",
        ),
        Panel(
            "link_verdicts",
            "Link and NIC incidents",
            "table",
            f"""SELECT detected, status, link, cause, src_rank, dst_rank,
       round(severity * 100, 1) AS lost_pct, summary
FROM {DB}.verdicts FINAL
WHERE job = '${{job}}' AND $__timeFilter(detected)
  AND (kind = 'link_degradation' OR cause IN ('network_link', 'nic'))
ORDER BY detected""",
        ),
        Panel(
            "proxy_waits",
            "Proxy wait states per edge (ms)",
            "table",
            f"""SELECT rank, peer, direction, count() AS ops,
       round(sum(send_wait_ns) / 1e6, 1) AS send_wait_ms,
       round(sum(recv_wait_ns) / 1e6, 1) AS recv_wait_ms,
       round(sum(send_gpu_wait_ns) / 1e6, 1) AS send_gpu_wait_ms,
       round(sum(recv_gpu_wait_ns) / 1e6, 1) AS recv_gpu_wait_ms
FROM {DB}.proxy_events FINAL
WHERE job = '${{job}}' AND $__timeFilter(first)
GROUP BY rank, peer, direction ORDER BY send_wait_ms DESC LIMIT 20""",
            width=24,
            description="Decision table: long SendWait/RecvWait on one edge = link/NIC; "
            "long SendGPUWait at the sender = its GPU is late.",
        ),
    ],
    variables=[_JOB, _NODE],
)

DASHBOARDS: tuple[Dashboard, ...] = (FLEET, JOB, LINKS)


def dashboard_path(d: Dashboard) -> Path:
    return HERE / "dashboards" / f"{d.uid}.json"


def write_all() -> list[Path]:
    """Write every dashboard's JSON file (run after editing a panel)."""
    out = []
    for d in DASHBOARDS:
        path = dashboard_path(d)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render(d))
        out.append(path)
    return out


def main() -> None:
    for path in write_all():
        print(path)


if __name__ == "__main__":
    main()
