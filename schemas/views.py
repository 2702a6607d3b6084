"""The query model: views and materialized views over the tables, for the
questions an on-call engineer asks (and the Grafana panels that ask them).

Materialized views only feed targets that stay exact under an at-least-once
replay: a ``ReplacingMergeTree`` on a natural key, or ``min``/``max``
aggregates, which a duplicate cannot change. Link minutes also keep an
average, which a replayed duplicate would weigh twice; panels that must be
exact read ``link_samples FINAL``. Plain views read their tables with
``FINAL`` so they always answer with the latest revision of a verdict.

Questions, and where they are answered:

- which jobs are unhealthy now: ``job_status``
- the verdict timeline of a job: ``verdicts FINAL``
- step time per job with change points: ``steps`` and ``verdicts`` (onsets)
- the rank x step lateness heat map: ``rank_steps``
- per-link throughput: ``link_minutes`` (and ``link_samples``)
- the critical path of a step: ``steps.critical_path``
- top offending nodes across the fleet: ``node_incidents``
- which communicators' records did not meet cleanly (late, out of order,
  dropped, partial): ``comm_accounts``

>>> [v.name for v in VIEWS if not v.name.endswith("_mv")]
['job_activity', 'node_incidents', 'link_minutes', 'job_status', 'comm_accounts']
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class View:
    """One statement of the query model; ``{db}`` and ``{ttl}`` are filled in at creation."""

    name: str
    sql: str

    def ddl(self, database: str, retention_days: int) -> str:
        ttl = "" if retention_days <= 0 else f"INTERVAL {retention_days} DAY"
        return self.sql.format(db=database, ttl=ttl and f"\nTTL toDateTime(ts) + {ttl}")


VIEWS: tuple[View, ...] = (
    # Last sign of life and last step of every job: max() is exact under replay.
    View(
        "job_activity",
        """CREATE TABLE IF NOT EXISTS {db}.job_activity (
  job String,
  ts SimpleAggregateFunction(max, DateTime64(9, 'UTC')),
  last_heartbeat_ns SimpleAggregateFunction(max, Int64),
  last_step SimpleAggregateFunction(max, Int64),
  ranks SimpleAggregateFunction(max, Int64)
) ENGINE = AggregatingMergeTree ORDER BY job{ttl}""",
    ),
    View(
        "job_activity_mv",
        """CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.job_activity_mv TO {db}.job_activity AS
SELECT job, max(ts) AS ts, max(ts_ns) AS last_heartbeat_ns,
       max(ifNull(step, -1)) AS last_step, max(rank) + 1 AS ranks
FROM {db}.heartbeats GROUP BY job""",
    ),
    # Every incident that names a node, latest revision wins (exact under replay).
    View(
        "node_incidents",
        """CREATE TABLE IF NOT EXISTS {db}.node_incidents (
  node String, job String, verdict_id String, revision Int64,
  ts DateTime64(9, 'UTC'), kind LowCardinality(String), cause LowCardinality(String),
  status LowCardinality(String), rank Nullable(Int64), severity Float64
) ENGINE = ReplacingMergeTree(revision) ORDER BY (node, job, verdict_id){ttl}""",
    ),
    View(
        "node_incidents_mv",
        """CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.node_incidents_mv TO {db}.node_incidents AS
SELECT assumeNotNull(node) AS node, job, verdict_id, revision,
       fromUnixTimestamp64Nano(onset_ns, 'UTC') AS ts,
       kind, cause, status, rank, severity
FROM {db}.verdicts WHERE node IS NOT NULL""",
    ),
    # Per-link throughput per minute: min and max are exact, avg weighs replays twice.
    View(
        "link_minutes",
        """CREATE TABLE IF NOT EXISTS {db}.link_minutes (
  job String, ts DateTime64(9, 'UTC'), link String, src_rank Int64, dst_rank Int64,
  min_gbps SimpleAggregateFunction(min, Float64),
  max_gbps SimpleAggregateFunction(max, Float64),
  avg_gbps AggregateFunction(avg, Float64)
) ENGINE = AggregatingMergeTree ORDER BY (job, link, ts, src_rank, dst_rank){ttl}""",
    ),
    View(
        "link_minutes_mv",
        """CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.link_minutes_mv TO {db}.link_minutes AS
SELECT job, toStartOfMinute(ts) AS ts,
       concat(node, '/', nic, '->', dst_node, '/', dst_nic) AS link,
       src_rank, dst_rank, min(throughput_gbps) AS min_gbps, max(throughput_gbps) AS max_gbps,
       avgState(throughput_gbps) AS avg_gbps
FROM {db}.link_samples GROUP BY job, ts, link, src_rank, dst_rank""",
    ),
    # Which jobs are unhealthy now: open incidents, their worst severity, silence.
    View(
        "job_status",
        """CREATE OR REPLACE VIEW {db}.job_status AS
WITH v AS (
  SELECT job, countIf(status != 'resolved') AS open_incidents,
         countIf(status != 'resolved' AND kind = 'hang') AS open_hangs,
         maxIf(severity, status != 'resolved') AS worst_severity,
         argMaxIf(summary, severity, status != 'resolved') AS worst_summary,
         max(detected_ns) AS last_verdict_ns
  FROM {db}.verdicts FINAL GROUP BY job
), a AS (
  SELECT job, max(last_heartbeat_ns) AS last_heartbeat_ns, max(last_step) AS last_step,
         max(ranks) AS ranks
  FROM {db}.job_activity GROUP BY job
)
SELECT a.job AS job, a.ranks AS ranks, a.last_step AS last_step,
       fromUnixTimestamp64Nano(a.last_heartbeat_ns, 'UTC') AS last_heartbeat,
       ifNull(v.open_incidents, 0) AS open_incidents,
       ifNull(v.worst_severity, 0) AS worst_severity,
       ifNull(v.worst_summary, '') AS worst_summary,
       multiIf(ifNull(v.open_hangs, 0) > 0, 'hung',
               ifNull(v.open_incidents, 0) > 0, 'degraded', 'healthy') AS health
FROM a LEFT JOIN v ON a.job = v.job
SETTINGS join_use_nulls = 1""",
    ),
    # Each communicator's newest account (align_stats rows are cumulative), with its role
    # and members; ``ts`` is when it was told.
    View(
        "comm_accounts",
        """CREATE OR REPLACE VIEW {db}.comm_accounts AS
SELECT s.job AS job, s.comm_hash AS comm_hash, c.role AS role, c.ranks AS ranks, s.ts AS ts,
       s.n AS records, s.late AS late_records, s.out_of_order AS out_of_order_records,
       s.dropped AS dropped_instances, s.partial AS partial_reports,
       s.open_now AS open_instances, s.lost AS lost_instances
FROM (
  SELECT job, comm_hash, max(ts) AS ts,
         argMax(records, (ts_ns, records)) AS n,
         argMax(late_records, (ts_ns, records)) AS late,
         argMax(out_of_order_records, (ts_ns, records)) AS out_of_order,
         argMax(dropped_instances, (ts_ns, records)) AS dropped,
         argMax(partial_reports, (ts_ns, records)) AS partial,
         argMax(open_instances, (ts_ns, records)) AS open_now,
         argMax(lost_instances, (ts_ns, records)) AS lost
  FROM {db}.align_stats FINAL GROUP BY job, comm_hash
) AS s
LEFT JOIN (
  SELECT job, comm_hash, any(role) AS role, any(ranks) AS ranks
  FROM {db}.comms FINAL GROUP BY job, comm_hash
) AS c ON c.job = s.job AND c.comm_hash = s.comm_hash""",
    ),
)


__all__ = ["VIEWS", "View"]
