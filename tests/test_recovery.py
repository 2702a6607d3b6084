"""kill -9 of the flow mid-run, then a restart: nothing lost, nothing duplicated in ClickHouse.

What this proves: the flow's recovery store (Bytewax snapshots of Kafka offsets
and detector state) plus idempotent ClickHouse tables make a killed flow
resume at-least-once without duplicates. The broker keeps running throughout
(the local Tansu broker is memory-only: its own restart is not covered here).
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from contextlib import closing
from pathlib import Path

import pytest

from detectors.replay import Replay
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
out = {}
for t in sys.argv[3:]:
    c.command(f"OPTIMIZE TABLE {db}.{t} FINAL")
    out[t] = c.query(f"SELECT count() FROM {db}.{t}").result_rows[0][0]
ids = c.query(f"SELECT verdict_id FROM {db}.verdicts").result_rows
out["verdict_ids"] = sorted({r[0] for r in ids})
print(json.dumps(out))
"""


def _wait_for_a_commit(store: Path, flow: subprocess.Popen[bytes], timeout_s: float = 120) -> int:
    """Wait until the flow's recovery store holds a committed epoch (it is mid-run: some of
    its input is stored, and a restart resumes from there) or the flow ended; return the
    epoch (0: none). A fixed sleep was too long once the flow got faster."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and flow.poll() is None:
        try:
            with closing(sqlite3.connect(f"file:{store}?mode=ro", uri=True, timeout=0.1)) as c:
                (epoch,) = c.execute("SELECT max(commit_epoch) FROM commits").fetchone()
            if epoch:
                return int(epoch)
        except sqlite3.OperationalError:
            pass  # not made yet, or being written
        time.sleep(0.02)
    return 0


def test_killed_flow_resumes_without_loss_or_duplicates(settings: Settings, tmp_path: Path) -> None:
    run = build("story", scale="demo", seed=2, steps=36)
    records = list(run.records())
    pub = publisher(settings)
    pub.publish_all(records)
    pub.flush()
    url = f"chdb://{tmp_path / 'ch'}"
    cmd = megatrace_cmd(settings, url, "rec", tmp_path / "st", "db", "init")
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    flow = [
        *cmd[:-2],
        "run",
        "--once",
        "--quiet",
        "--recovery-dir",
        str(tmp_path / "rec"),
        "--snapshot-s",
        "0.3",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    first = subprocess.Popen(flow, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    epoch = _wait_for_a_commit(tmp_path / "rec" / "part-0.sqlite3", first)
    assert first.poll() is None, "the flow finished before it could be killed: test proves nothing"
    assert epoch, "the flow committed nothing before it was killed"
    os.kill(first.pid, signal.SIGKILL)
    first.wait(10)
    second = subprocess.run(flow, capture_output=True, timeout=300, env=env)
    assert second.returncode == 0, second.stderr[-2000:]

    expected = Counter(TABLE_FOR[type(r)].name for r in records)
    tables = sorted(expected)
    out = subprocess.run(
        [sys.executable, "-c", READ, url, "rec", *tables],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    for t in tables:
        assert got[t] == expected[t], f"{t}: {got[t]} rows stored, {expected[t]} published"
    straight = {v.verdict_id for v in Replay().run(records) if isinstance(v, Verdict)}
    assert got["verdict_ids"] == sorted(straight)
