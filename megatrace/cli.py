"""The ``megatrace`` command: parses argv, loads settings, composes the pieces.

No domain logic lives here; each command calls into ``infra``, ``producers``,
``flows`` or ``detectors``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import click

from schemas.config import ConfigError, Settings, config_file_path, load_settings


class _Ctx:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def stack(self):
        from infra.stack import Stack

        return Stack(self.settings)


def _overrides(**flags: Any) -> dict[str, Any]:
    """Command-line flags as a settings layer (only the flags that were given)."""
    layer: dict[str, Any] = {}
    mapping = {
        "bootstrap_servers": ("kafka", "bootstrap_servers"),
        "partitions": ("kafka", "partitions"),
        "topic_prefix": ("kafka", "topic_prefix"),
        "clickhouse_url": ("clickhouse", "url"),
        "database": ("clickhouse", "database"),
        "retention_days": ("clickhouse", "retention_days"),
        "state_dir": ("stack", "state_dir"),
    }
    for name, value in flags.items():
        if value is not None:
            section, key = mapping[name]
            layer.setdefault(section, {})[key] = value
    return layer


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML config file.")
@click.option("--bootstrap-servers", help="Kafka bootstrap servers (default: the local stack).")
@click.option("--partitions", type=int, help="Partitions per topic when creating topics.")
@click.option("--topic-prefix", help="Prefix of every topic name.")
@click.option("--clickhouse-url", help="chdb:///DIR or http(s)://user:pass@host:port/db.")
@click.option("--database", help="ClickHouse database name.")
@click.option("--retention-days", type=int, help="TTL of every table in days (0: keep).")
@click.option("--state-dir", help="Local stack directory (broker files, embedded ClickHouse).")
@click.pass_context
def cli(ctx: click.Context, config_file: str | None, **flags: Any) -> None:
    """megatrace: find and localise hangs and slowdowns in distributed training.

    Settings precedence: defaults < config file (--config, $MEGATRACE_CONFIG or
    ./megatrace.toml) < environment (MEGATRACE_<SECTION>__<KEY>) < these flags.
    """
    env = dict(os.environ)
    try:
        path = config_file_path(config_file, env, Path.cwd())
        settings = load_settings(file=path, env=env, overrides=_overrides(**flags))
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    ctx.obj = _Ctx(settings)


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


def _redact(url: str) -> str:
    from schemas.config import redact_url

    return redact_url(url)


@cli.group()
def db() -> None:
    """ClickHouse schema management."""


@db.command("init")
@click.pass_obj
def db_init(obj: _Ctx) -> None:
    """Create the database and tables (idempotent)."""
    from infra.clickhouse import init_db

    s = obj.stack()
    tables = init_db(
        s.clickhouse(), obj.settings.clickhouse.database, obj.settings.clickhouse.retention_days
    )
    click.echo(
        f"{_redact(s.clickhouse_url())}: {obj.settings.clickhouse.database} with "
        f"{len(tables)} tables ({', '.join(tables)})"
    )


@cli.command("deadletters")
@click.pass_obj
def deadletters(obj: _Ctx) -> None:
    """Count refused records per reason (from ClickHouse)."""
    s = obj.stack()
    rows = (
        s.clickhouse()
        .query(
            f"SELECT reason, count() FROM {obj.settings.clickhouse.database}.dead_letters FINAL "
            "GROUP BY reason ORDER BY reason"
        )
        .result_rows
    )
    for reason, n in rows:
        click.echo(f"{reason:>16}  {n}")
    if not rows:
        click.echo("no dead letters")


# --------------------------------------------------------------------------- flow


def _flow_config(obj: _Ctx, tail: bool):
    from flows.main import FlowConfig
    from infra.kafka import consumer_config, producer_config

    s = obj.stack()
    bootstrap = s.bootstrap()

    def options(conf: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in conf.items() if k != "bootstrap.servers"}

    return FlowConfig(
        brokers=bootstrap.split(","),
        consumer_options=options(consumer_config(obj.settings.kafka, bootstrap)),
        producer_options=options(producer_config(obj.settings.kafka, bootstrap)),
        topics=s.topics,
        clickhouse_url=s.clickhouse_url(),
        database=obj.settings.clickhouse.database,
        tail=tail,
    )


@cli.command("run")
@click.option("--once", is_flag=True, help="Stop at the end of the topics instead of tailing.")
@click.pass_obj
def run(obj: _Ctx, once: bool) -> None:
    """Run the dataflow against the configured broker and ClickHouse."""
    from bytewax.testing import run_main

    from flows.main import build_flow

    run_main(build_flow(_flow_config(obj, tail=not once)))


@cli.command("demo")
@click.option("--nodes", default=2, show_default=True)
@click.option("--gpus-per-node", default=4, show_default=True)
@click.option("--steps", default=20, show_default=True)
@click.pass_obj
def demo(obj: _Ctx, nodes: int, gpus_per_node: int, steps: int) -> None:
    """End to end on the embedded defaults: records -> broker -> flow -> ClickHouse."""
    from bytewax.testing import run_main

    from flows.main import build_flow
    from infra.clickhouse import read_records
    from infra.kafka import producer_config
    from producers.publish import KafkaPublisher
    from producers.sample import sample_job

    s = obj.stack()
    s.up()
    click.echo(f"[1/4] stack up: broker {s.bootstrap()}, clickhouse {_redact(s.clickhouse_url())}")
    job = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    pub = KafkaPublisher(producer_config(obj.settings.kafka, s.bootstrap()), s.topics)
    n = pub.publish_all(
        sample_job(job, nodes=nodes, gpus_per_node=gpus_per_node, steps=steps, t0_ns=time.time_ns())
    )
    for bad in (
        b'{"type":"hb","job":"' + job.encode() + b'","node":"n","rank":-1,"ts_ns":1}',
        b"not json at all",
        b'{"type":"hb","v":99,"job":"x"}',
    ):
        pub.publish_raw(s.topics.heartbeat, job.encode(), bad)
    pub.flush()
    click.echo(f"[2/4] published {n} records of job {job} (+3 deliberately bad ones)")
    t0 = time.monotonic()
    run_main(build_flow(_flow_config(obj, tail=False)))
    click.echo(f"[3/4] flow consumed the topics in {time.monotonic() - t0:.1f}s")
    client = s.clickhouse()
    db_name = obj.settings.clickhouse.database
    click.echo("[4/4] read back from ClickHouse:")
    for table in (
        "jobs",
        "ranks",
        "comms",
        "collective_events",
        "proxy_events",
        "kernel_events",
        "link_samples",
        "heartbeats",
    ):
        count = sum(1 for _ in read_records(client, db_name, table, "job = {j:String}", {"j": job}))
        click.echo(f"  {table:>18}: {count}")
    dead = client.query(
        f"SELECT reason, error FROM {db_name}.dead_letters FINAL WHERE key = {{j:String}}",
        parameters={"j": job},
    ).result_rows
    for reason, error in dead:
        click.echo(f"  dead letter [{reason}] {error}")


@cli.group()
def bench() -> None:
    """Benchmarks that print tables."""


@bench.command("codec")
@click.option("--records", default=200_000, show_default=True)
def bench_codec(records: int) -> None:
    """Decode throughput of json, orjson and msgspec on collective records."""
    from schemas.bench import codec_table

    for line in codec_table(records):
        click.echo(line)


def main() -> None:
    try:
        cli(standalone_mode=True)
    except KeyboardInterrupt:
        sys.exit(130)
