"""Fixtures: a real Tansu broker and the real embedded ClickHouse engine, per test session.

chDB opens one data directory per process, so the session shares one directory
and each test gets its own database; each test also gets its own topic prefix.
"""

from __future__ import annotations

import importlib.util
import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from infra.broker import BrokerInfo, LocalBroker
from infra.clickhouse import connect, init_db
from infra.kafka import ensure_topics
from schemas.config import Settings, load_settings
from schemas.topics import Topics

_counter = itertools.count()

#: Helper scripts that import an optional extra at the top: ``--doctest-modules`` imports
#: every module, so without the extra they are left out of the collection (the tests that
#: run them skip themselves, saying which extra they need).
collect_ignore = [] if importlib.util.find_spec("torch") else ["torch_job.py", "fr_job.py"]


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerInfo]:
    local = LocalBroker(tmp_path_factory.mktemp("broker"))
    info, _ = local.up()
    yield info
    local.down()


@pytest.fixture(scope="session")
def clickhouse_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"chdb://{tmp_path_factory.mktemp('clickhouse')}"


@pytest.fixture(scope="session")
def ch(clickhouse_url: str) -> Any:
    return connect(clickhouse_url)


@pytest.fixture
def database(ch: Any) -> str:
    name = f"t{next(_counter)}_{time.time_ns() % 10**9}"
    init_db(ch, name, retention_days=0)
    return name


@pytest.fixture
def settings(broker: BrokerInfo, clickhouse_url: str, database: str, tmp_path: Path) -> Settings:
    """Settings pointing at the session's broker and ClickHouse, with fresh topics."""
    s = load_settings(
        overrides={
            "kafka": {
                "bootstrap_servers": broker.bootstrap,
                "topic_prefix": f"t{next(_counter)}.",
                "partitions": 2,
            },
            "clickhouse": {"url": clickhouse_url, "database": database, "retention_days": 0},
            "stack": {"state_dir": str(tmp_path / "state")},
        }
    )
    ensure_topics(s.kafka, broker.bootstrap, Topics(prefix=s.kafka.topic_prefix))
    return s


@pytest.fixture(scope="session")
def story(ch: Any) -> dict[str, Any]:
    """The demo's faulty job, analysed by the detectors and stored as the flow stores it:
    a degraded link from step 7, a slow GPU on rank 15 from step 18, and rank 5
    never posting a Recv at step 32 (timestamps around now)."""
    from detectors.replay import Replay
    from infra.clickhouse import insert_records
    from producers.sim.scenarios import build

    db = f"story_{time.time_ns() % 10**9}"
    init_db(ch, db, retention_days=0)
    run = build("story", scale="demo", seed=0, now=True)
    records = list(run.records())
    results = list(Replay().run(records))
    insert_records(ch, db, [*records, *results, *run.labels])
    now = int(time.time())
    return {"db": db, "job": run.spec.job, "range": (now - 3600, now + 3600), "labels": run.labels}
