"""The ``megatrace`` command group, its settings and what its commands share (the
commands themselves: :mod:`megatrace.cli`, :mod:`megatrace.cli_import`,
:mod:`megatrace.cli_quality`)."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
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


class _Commands(click.Group):
    """The command group: an error the user can act on (ClickHouse unreachable or refusing,
    the local stack not running) ends the command with its one line, not a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        from infra.clickhouse import ClickHouseError
        from infra.stack import StackNotRunning

        try:
            return super().invoke(ctx)
        except (ClickHouseError, StackNotRunning) as e:
            raise click.ClickException(str(e)) from None


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
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
    tune_gc()


def tune_gc() -> None:
    """Collect garbage less often in this process (every ``megatrace`` command's).

    The detectors keep many small objects alive (open collectives, step accumulators,
    a job's tables), and each record allocates a few more: at the default
    generation-0 threshold the collector walks the live ones over and over, the
    same work each time, in a flow and in an offline analysis alike.
    """
    gc.set_threshold(50_000, 20, 100)


def _redact(url: str) -> str:
    from schemas.secrets import redact_url

    return redact_url(url)


def _flow_config(obj: _Ctx, tail: bool, **overrides: Any):
    from flows.flow_config import flow_config

    s = obj.stack()
    return flow_config(obj.settings, s.bootstrap(), s.clickhouse_url(), tail=tail, **overrides)


def _publish(
    obj: _Ctx, records: Any, label: str, first_offsets: dict[str, int] | None = None
) -> int:
    """Publish records to the configured broker with a progress bar; return how many.

    ``first_offsets``, if given, receives where the records begin in each partition
    they went to (the flow's ``start_offsets``)."""
    from flows.kafka_source import part_name
    from infra.kafka import producer_config
    from producers.publish import KafkaPublisher

    s = obj.stack()
    pub = KafkaPublisher(producer_config(obj.settings.kafka, s.bootstrap()), s.topics)
    n = 0
    with click.progressbar(length=0, label=label, show_pos=True) as bar:
        for rec in records:
            pub.publish(rec)
            n += 1
            if n % 5000 == 0:
                bar.update(5000)
        bar.update(n % 5000)
    pub.flush()
    if first_offsets is not None:
        first_offsets.update({part_name(*tp): off for tp, off in pub.first_offsets.items()})
    return n


@contextlib.contextmanager
def _flow_errors_are_one_line() -> Iterator[None]:
    """A flow that stopped for a reason the user can act on - its broker stayed away
    (:class:`BrokerLost`), ClickHouse could not take its inserts (:class:`SinkError`) -
    ends the command with that one line: Bytewax wraps the error, and reports it first
    as a panic of its worker, which is held back (:mod:`megatrace.stderr`) and printed
    only for other errors."""
    from flows.kafka_source import BrokerLost
    from flows.sinks import SinkError
    from megatrace.stderr import panic_filter, release

    error: BaseException | None = None
    with panic_filter() as held:
        try:
            yield
        except Exception as e:
            error = e
    cause = error
    while cause is not None and not isinstance(cause, BrokerLost | SinkError):
        cause = cause.__cause__ or cause.__context__
    release(held, explained=cause is not None)
    if cause is not None:
        raise click.ClickException(str(cause)) from None
    if error is not None:
        raise error


def _stop_on_signal():
    import signal
    import threading

    event = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: event.set())
    return event
