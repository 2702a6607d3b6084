"""The local stack: a broker process, the topics, and the embedded ClickHouse directory.

It also answers "where is Kafka, where is ClickHouse" for every command: the
configured addresses if set, else the local stack's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from infra.broker import BrokerInfo, LocalBroker
from infra.clickhouse import ClickHouseError, connect, init_db
from infra.kafka import ensure_topics
from schemas.config import Settings
from schemas.topics import Topics


class StackNotRunning(RuntimeError):
    """No broker is configured and the local stack is not up."""


@dataclass(frozen=True)
class StackStatus:
    broker: BrokerInfo | None
    clickhouse_url: str
    topics: tuple[str, ...]


class Stack:
    """Resolves and manages the components named by one :class:`Settings`."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.state_dir = Path(settings.stack.state_dir)
        self.broker = LocalBroker(self.state_dir)
        self.topics = Topics(prefix=settings.kafka.topic_prefix)

    @property
    def uses_local_broker(self) -> bool:
        return not self.settings.kafka.bootstrap_servers

    def bootstrap(self) -> str:
        """The Kafka bootstrap servers to use."""
        if not self.uses_local_broker:
            return self.settings.kafka.bootstrap_servers
        info = self.broker.status()
        if info is None:
            raise StackNotRunning(
                "no Kafka configured and the local broker is not running: run "
                "`megatrace stack up`, or set MEGATRACE_KAFKA__BOOTSTRAP_SERVERS"
            )
        return info.bootstrap

    def clickhouse_url(self) -> str:
        url = self.settings.clickhouse.url.get()
        return url or f"chdb://{(self.state_dir / 'clickhouse').resolve()}"

    def clickhouse(self):
        return connect(self.clickhouse_url())

    def up(self) -> tuple[StackStatus, bool]:
        """Start what is local and missing, create topics and tables; idempotent."""
        started = False
        if self.uses_local_broker:
            _, started = self.broker.up(
                port=self.settings.stack.broker_port,
                timeout_s=self.settings.stack.start_timeout_s,
            )
        ensure_topics(self.settings.kafka, self.bootstrap(), self.topics)
        self.init_db()
        return self.status(), started

    def init_db(self) -> list[str]:
        """The database and its tables (:func:`~infra.clickhouse.init_db`); for the
        embedded engine, an error says where its data is."""
        try:
            return init_db(
                self.clickhouse(),
                self.settings.clickhouse.database,
                self.settings.clickhouse.retention_days,
            )
        except ClickHouseError as err:
            if self.settings.clickhouse.url.get():
                raise
            raise ClickHouseError(
                f"{err}. The embedded ClickHouse keeps its data in "
                f"{self.state_dir / 'clickhouse'}: remove that folder to start afresh, or "
                f"set MEGATRACE_CLICKHOUSE__DATABASE to another database"
            ) from None

    def down(self) -> bool:
        return self.broker.down()

    def status(self) -> StackStatus:
        return StackStatus(self.broker.status(), self.clickhouse_url(), self.topics.all)
