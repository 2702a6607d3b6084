"""Two flow processes over partitioned topics agree with one process."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from detectors.replay import Replay
from infra.broker import free_port
from producers.sim.scenarios import build
from schemas.config import Settings
from schemas.results import Verdict
from schemas.tables import TABLE_FOR
from tests.helpers import megatrace_cmd, publisher

pytestmark = [pytest.mark.integration, pytest.mark.serial]

READ = """
import json, sys
from infra.clickhouse import connect
c = connect(sys.argv[1]); db = sys.argv[2]
out = {t: c.query(f"SELECT count() FROM {db}.{t} FINAL").result_rows[0][0] for t in sys.argv[3:]}
out["verdicts"] = sorted(list(r) for r in c.query(
    f"SELECT verdict_id, kind, rank, onset_step, link FROM {db}.verdicts FINAL").result_rows)
print(json.dumps(out))
"""


def test_two_processes_store_and_conclude_what_one_does(settings: Settings, tmp_path: Path) -> None:
    run = build("story", scale="tiny", seed=4, steps=30, kernels=False)
    records = list(run.records())
    pub = publisher(settings)
    pub.publish_all(records)
    pub.flush()
    addresses = f"127.0.0.1:{free_port()};127.0.0.1:{free_port()}"
    procs = []
    urls = [f"chdb://{tmp_path / f'ch{i}'}" for i in range(2)]
    for i, url in enumerate(urls):
        subprocess.run(
            megatrace_cmd(settings, url, "so", tmp_path, "db", "init"),
            check=True,
            capture_output=True,
            timeout=120,
        )
        procs.append(
            subprocess.Popen(
                megatrace_cmd(
                    settings,
                    url,
                    "so",
                    tmp_path,
                    "run",
                    "--once",
                    "--quiet",
                    "--process-id",
                    str(i),
                    "--addresses",
                    addresses,
                ),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        )
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
    expected = Counter(TABLE_FOR[type(r)].name for r in records)
    tables = sorted(expected)
    stored: Counter[str] = Counter()
    verdicts: list[list] = []
    for url in urls:
        out = subprocess.run(
            [sys.executable, "-c", READ, url, "so", *tables],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        got = json.loads(out.stdout.strip().splitlines()[-1])
        verdicts += got.pop("verdicts")
        stored.update(got)
    assert dict(stored) == dict(expected)  # each partition was read by exactly one process
    one_process = {
        v.verdict_id: [v.verdict_id, v.kind.value, v.rank, v.onset_step, v.link]
        for v in Replay().run(records)
        if isinstance(v, Verdict)
    }
    assert sorted(verdicts) == sorted(one_process.values())
