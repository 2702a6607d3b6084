"""The flow's configuration (:class:`FlowConfig`), resolved from
:class:`~schemas.config.Settings` and the addresses the command line found, and what
a flow process does (:class:`Role`) with the topics it reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from detectors.route import (
    POLL,
)
from schemas.config import AlertSettings, ClickHouseSettings, DetectSettings, Settings
from schemas.topics import Topics

_CLICKHOUSE = ClickHouseSettings()  # the defaults' one home


class Role(StrEnum):
    """What a flow process does (see the module docstring)."""

    ALL = "all"
    STORE = "store"
    DETECT = "detect"


@dataclass(frozen=True)
class FlowConfig:
    """Everything the flow needs, resolved by the command line from :class:`Settings`."""

    brokers: list[str]
    consumer_options: dict[str, Any]  # librdkafka settings (and its throttled logger)
    producer_options: dict[str, Any]
    topics: Topics
    clickhouse_url: str
    database: str
    tail: bool = True
    batch_size: int = POLL
    idle_stop_s: float = 1.5
    #: a bounded run fails once the broker did not answer for this long
    outage_wait_s: float = 300.0
    detect: DetectSettings = field(default_factory=DetectSettings)
    alerts: AlertSettings = field(default_factory=AlertSettings)
    console: bool = True
    role: Role = Role.ALL
    #: called with (records, oldest producer time ms, stored time ms) after raw rows are
    #: stored (roles ``all`` and ``store``)
    on_stored: Callable[[int, int, int], None] | None = None
    #: called with the number of records of every poll that returned some
    on_read: Callable[[int], None] | None = None
    #: a fresh start reads only these source partitions (``part_name`` -> first offset),
    #: e.g. the records one publisher delivered; None: every partition from its start
    start_offsets: dict[str, int] | None = None
    #: a bounded run over input still being written ends, once quiet, only when this says
    #: nothing more is coming (a live job its caller watches)
    input_complete: Callable[[], bool] | None = None
    #: the flow's own rows are inserted per table by this many, or after this long
    batch_rows: int = _CLICKHOUSE.batch_rows
    batch_ms: int = _CLICKHOUSE.batch_ms
    #: the raw tables' inserts gather ``batch_rows`` rows, or wait this long at most
    raw_batch_ms: int = _CLICKHOUSE.raw_batch_ms
    #: records older than this are refused (the tables' TTL would drop them); 0: keep all
    retention_days: int = 0
    #: an insert ClickHouse cannot take is tried again for this long, then the flow stops
    clickhouse_outage_wait_s: float = _CLICKHOUSE.outage_wait_s

    @property
    def consumer(self) -> dict[str, Any]:
        """The librdkafka settings of the flow's consumers."""
        return {"bootstrap.servers": ",".join(self.brokers), **self.consumer_options}


def flow_config(
    settings: Settings, bootstrap: str, clickhouse_url: str, **overrides: object
) -> FlowConfig:
    """The flow's configuration from :class:`Settings` and the resolved addresses."""
    from infra.kafka import consumer_config, producer_config

    def options(conf: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in conf.items() if k != "bootstrap.servers"}

    base = FlowConfig(
        brokers=bootstrap.split(","),
        consumer_options=options(consumer_config(settings.kafka, bootstrap)),
        producer_options=options(producer_config(settings.kafka, bootstrap)),
        topics=Topics(prefix=settings.kafka.topic_prefix),
        clickhouse_url=clickhouse_url,
        database=settings.clickhouse.database,
        outage_wait_s=settings.kafka.outage_wait_s,
        detect=settings.detect,
        alerts=settings.alerts,
        batch_rows=settings.clickhouse.batch_rows,
        batch_ms=settings.clickhouse.batch_ms,
        raw_batch_ms=settings.clickhouse.raw_batch_ms,
        retention_days=settings.clickhouse.retention_days,
        clickhouse_outage_wait_s=settings.clickhouse.outage_wait_s,
    )
    return dataclasses.replace(base, **overrides)  # type: ignore[arg-type]


def input_topics(cfg: FlowConfig) -> list[str]:
    """The topics a flow of this role reads (``detect`` skips kernels: only stored raw)."""
    topics = list(cfg.topics.inputs)
    if cfg.role == Role.DETECT:
        topics.remove(cfg.topics.kernel)
    return topics
