"""The ``megatrace`` command: parses argv, loads settings, composes the pieces.

No domain logic lives here; each command calls into ``infra``, ``producers``,
``flows`` or ``detectors``. This module holds the settings, stack and flow commands;
the group and what commands share are :mod:`megatrace.cli_base`'s, the importers
:mod:`megatrace.cli_import`'s, simulated jobs and reports :mod:`megatrace.cli_demo`'s,
detection quality and cost :mod:`megatrace.cli_quality`'s.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import click
import msgspec

from megatrace.cli_base import (
    _Ctx,
    _flow_config,
    _flow_errors_are_one_line,
    _redact,
    _stop_on_signal,
    cli,
)

# --------------------------------------------------------------------------- config / schema


@cli.group()
def config() -> None:
    """Inspect the effective configuration."""


@config.command("show")
@click.pass_obj
def config_show(obj: _Ctx) -> None:
    """Print the effective settings (secrets masked)."""
    click.echo(json.dumps(obj.settings.public(), indent=2))


@cli.group()
def schema() -> None:
    """The record schema for producers in other languages."""


@schema.command("export")
@click.option("--out", type=click.Path(dir_okay=False), help="Write to a file instead of stdout.")
def schema_export(out: str | None) -> None:
    """Print the JSON Schema of every record type."""
    from schemas.codec import json_schema

    text = json.dumps(json_schema(), indent=2)
    if out:
        Path(out).write_text(text)
        click.echo(f"wrote {out}")
    else:
        click.echo(text)


# --------------------------------------------------------------------------- stack / db


@cli.group()
def stack() -> None:
    """The local stack: Tansu broker, topics, embedded ClickHouse."""


@stack.command("up")
@click.pass_obj
def stack_up(obj: _Ctx) -> None:
    """Start the local broker (once), create topics and tables."""
    status, started = obj.stack().up()
    b = status.broker
    if b is not None:
        click.echo(
            f"broker {'started' if started else 'already running'}: "
            f"{b.bootstrap} (pid {b.pid}, log {b.log})"
        )
    else:
        click.echo(f"broker: external {obj.settings.kafka.bootstrap_servers}")
    click.echo(f"topics: {', '.join(status.topics)}")
    click.echo(
        f"clickhouse: {_redact(status.clickhouse_url)} "
        f"(database {obj.settings.clickhouse.database})"
    )


@stack.command("down")
@click.pass_obj
def stack_down(obj: _Ctx) -> None:
    """Stop the local broker this state directory started."""
    stopped = obj.stack().down()
    click.echo("broker stopped" if stopped else "no local broker was running")


@stack.command("status")
@click.pass_obj
def stack_status(obj: _Ctx) -> None:
    """Say whether the local broker runs and where everything is."""
    st = obj.stack().status()
    if st.broker:
        click.echo(f"broker: running at {st.broker.bootstrap} (pid {st.broker.pid})")
    else:
        click.echo("broker: not running")
    click.echo(f"clickhouse: {_redact(st.clickhouse_url)}")


@cli.group()
def db() -> None:
    """ClickHouse schema management."""


@db.command("init")
@click.pass_obj
def db_init(obj: _Ctx) -> None:
    """Create the database and tables (idempotent)."""
    s = obj.stack()
    tables = s.init_db()
    click.echo(
        f"{_redact(s.clickhouse_url())}: {obj.settings.clickhouse.database} with "
        f"{len(tables)} tables ({', '.join(tables)})"
    )


@cli.command("deadletters")
@click.pass_obj
def deadletters(obj: _Ctx) -> None:
    """Count refused records per reason (from ClickHouse)."""
    from infra.queries import dead_letter_counts

    rows = dead_letter_counts(obj.stack().clickhouse(), obj.settings.clickhouse.database)
    for reason, n in rows:
        click.echo(f"{reason:>16}  {n}")
    if not rows:
        click.echo("no dead letters")


# --------------------------------------------------------------------------- flow


@cli.command("run")
@click.option("--once", is_flag=True, help="Stop when the topics stay quiet instead of tailing.")
@click.option(
    "--recovery-dir",
    type=click.Path(file_okay=False),
    help="Bytewax recovery store: a killed flow resumes from its last snapshot.",
)
@click.option(
    "--snapshot-s", default=5.0, show_default=True, help="Seconds between snapshots (epoch length)."
)
@click.option("--workers", default=1, show_default=True, help="Worker threads in this process.")
@click.option("--process-id", type=int, help="This process's index in a multi-process cluster.")
@click.option("--addresses", help="host:port of every process of the cluster, ';'-separated.")
@click.option("--quiet", is_flag=True, help="Do not print verdicts as they happen.")
@click.option(
    "--role",
    type=click.Choice(["all", "store", "detect"]),
    default="all",
    show_default=True,
    help="store: raw tables only; detect: analysis only (no kernel topic); all: both.",
)
@click.pass_obj
def run(
    obj: _Ctx,
    once: bool,
    recovery_dir: str | None,
    snapshot_s: float,
    workers: int,
    process_id: int | None,
    addresses: str | None,
    quiet: bool,
    role: str,
) -> None:
    """Run the dataflow against the configured broker and ClickHouse.

    Scale out with several processes (--process-id/--addresses) over partitioned
    topics; with the embedded ClickHouse each process needs its own directory.
    A large deployment runs --role store and --role detect clusters side by side
    (each with its own consumer position and recovery directory).
    """
    from datetime import timedelta

    from bytewax.recovery import RecoveryConfig, init_db_dir
    from bytewax.run import cli_main  # what `python -m bytewax.run` calls

    from flows.flow_config import Role, input_topics
    from flows.main import build_flow

    if (process_id is None) != (addresses is None):
        raise click.UsageError("--process-id and --addresses go together")
    recovery = None
    if recovery_dir:
        path = Path(recovery_dir)
        if not path.exists():
            path.mkdir(parents=True)
            init_db_dir(path, 1)
        recovery = RecoveryConfig(path)
    cfg = _flow_config(obj, tail=not once)
    from infra.clickhouse import init_db
    from infra.kafka import KafkaSetupError, topic_partitions

    cfg = dataclasses.replace(cfg, role=Role(role), console=not quiet)
    try:  # what the source asks first, asked here: Bytewax would bury the error in a trace
        topic_partitions(cfg.consumer, input_topics(cfg))
    except KafkaSetupError as e:
        raise click.ClickException(str(e)) from None
    init_db(obj.stack().clickhouse(), cfg.database, obj.settings.clickhouse.retention_days)
    with _flow_errors_are_one_line():
        cli_main(
            build_flow(cfg),
            workers_per_process=workers,
            process_id=process_id,
            addresses=addresses.split(";") if addresses else None,
            epoch_interval=timedelta(seconds=snapshot_s),
            recovery_config=recovery,
        )


@cli.command("agent")
@click.option("--job", help="Job id stamped on records that carry none.")
@click.option("--node", help="Node name stamped on records that carry none (default: hostname).")
@click.option("--socket", "socket_path", help="Unix datagram socket local producers send to.")
@click.option("--tail", "tails", multiple=True, help="Glob of JSON-lines files to follow.")
@click.option(
    "--inspector",
    "inspectors",
    multiple=True,
    help="Glob of the NCCL Inspector's output files to follow (its NCCL_INSPECTOR_DUMP_DIR).",
)
@click.option("--spool-dir", help="On-disk queue of accepted, undelivered records.")
@click.option(
    "--spool-max-mb",
    type=click.IntRange(min=1),
    help="Spool bound (undelivered MiB); beyond it records are dropped.",
)
@click.option("--health-file", help="JSON file the agent writes its health to.")
@click.option("--health-interval-s", type=float, help="Seconds between health reports.")
@click.pass_obj
def agent(obj: _Ctx, **flags: Any) -> None:
    """The node agent: local producers -> spool -> Kafka, nothing lost on broker outages."""
    from infra.kafka import producer_config
    from producers.agent import NodeAgent
    from producers.spool import SpoolError

    many = ("tails", "inspectors")
    over = {k: (list(v) if k in many else v) for k, v in flags.items() if v not in (None, ())}
    if "tails" in over:
        over["tail"] = over.pop("tails")
    if "inspectors" in over:
        over["inspector"] = over.pop("inspectors")
    if "socket_path" in over:
        over["socket"] = over.pop("socket_path")
    try:
        cfg = msgspec.structs.replace(obj.settings.agent, **over)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    st = obj.stack()
    bootstrap = st.bootstrap()
    try:
        node_agent = NodeAgent(
            cfg,
            producer_config(obj.settings.kafka, bootstrap),
            st.topics,
            Path(obj.settings.stack.state_dir),
        )
    except SpoolError as e:
        raise click.ClickException(str(e)) from None
    cfg = node_agent.settings  # with its paths resolved
    done = _stop_on_signal()
    node_agent.start()
    click.echo(
        f"agent on {node_agent.node}: socket {cfg.socket}, tailing {list(cfg.tail) or 'nothing'}, "
        f"spool {cfg.spool_dir} (max {cfg.spool_max_mb} MiB), broker {bootstrap}",
        err=True,
    )
    while not done.wait(cfg.health_interval_s):
        h = node_agent.write_health()
        dead = [name for name, up in h.threads.items() if not up]
        click.echo(
            f"agent: in {h.accepted} out {h.delivered} refused {h.refused} dropped {h.dropped} "
            f"lost {h.lost} spool {h.spool_bytes / 2**20:.1f} MiB (undelivered "
            f"{h.pending_bytes / 2**10:.0f} KiB) broker {'up' if h.broker_up else 'DOWN'}"
            + (f"; UNHEALTHY: {', '.join(dead)} stopped ({h.last_error})" if dead else ""),
            err=True,
        )
    node_agent.stop()
    h = node_agent.snapshot()
    click.echo(
        f"agent stopped: in {h.accepted} out {h.delivered} dropped {h.dropped} lost {h.lost}",
        err=True,
    )


@cli.command("build-plugin")
@click.option(
    "--out",
    default="build",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Directory for libmegatrace_nccl_profiler.so.",
)
def build_plugin(out: str) -> None:
    """Compile the NCCL profiler plugin (system C compiler; no NCCL headers or GPU needed)."""
    from producers.nccl_plugin import PluginBuildError, build

    try:
        lib = build(Path(out))
    except PluginBuildError as e:
        raise click.ClickException(str(e)) from None
    click.echo(str(lib.resolve()))
    click.echo(f"use it with: NCCL_PROFILER_PLUGIN={lib.resolve()} (and a node agent running)")


@cli.command("gpu-check")
@click.option(
    "--out",
    default="gpu-check",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Directory for the records, raw CUPTI activity, NCCL logs and summary.json.",
)
def gpu_check(out: str) -> None:
    """Smoke-test this GPU node: live CUPTI, the NCCL plugin under the real NCCL, the
    PyTorch collector on a GPU, and what CUPTI costs (needs a GPU, PyTorch, cupti-python)."""
    from producers.gpu_check import GpuCheckError, report, run_checks

    try:
        checks = run_checks(Path(out), progress=lambda m: click.echo(m, err=True))
    except GpuCheckError as e:
        raise click.ClickException(str(e)) from None
    click.echo(report(checks))
    if not all(c.ok for c in checks):
        raise SystemExit(1)


# the commands defined beside this module join the group when it is imported
from megatrace import cli_demo, cli_import, cli_quality  # noqa: E402, F401


def main() -> None:
    try:
        cli(standalone_mode=True)
    except KeyboardInterrupt:
        sys.exit(130)
