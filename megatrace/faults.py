"""``megatrace bench faults``: hostile input and faults against the real components, as
a table of what was tried, what survived, what was lost and what was duplicated.

Each row is one kind of fault:

* **codec**: hostile lines (:mod:`producers.sim.hostile`) decoded as a flow does; each
  must be a storable record or a schema error;
* **agent lines**: the same lines through the node agent's parser: each becomes a
  spooled record or a dead letter;
* **spool damage**: bytes flipped, segments cut short or deleted in a closed spool:
  every record is read back or counted as lost;
* **poison pills in the flow**: hostile lines on every input topic between a simulated
  job's records, through the real broker, the flow and ClickHouse;
* **flow killed**: ``kill -9`` of ``megatrace run`` at random points, each time resumed
  from its recovery store;
* **webhook**: an endpoint that fails, then hangs, while incidents are announced.

The flows run as processes of their own (chDB opens a data directory in one process
at a time, and a killed flow must be a process); their tables are read by another.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from producers.sim.hostile import hostile_lines
from schemas.codec import SchemaError, decode, decode_input, encode
from schemas.config import Settings

Say = Callable[[str], None]


@dataclass
class Row:
    fault: str
    tried: int
    survived: int
    lost: int
    duplicates: int | str
    note: str = ""


# --------------------------------------------------------------------------- in process


def codec_row(lines: list[bytes]) -> Row:
    from infra.rowbinary import Plan, encode_py
    from schemas.tables import TABLE_FOR

    survived = refused = 0
    for raw in lines:
        try:
            rec = decode_input(raw)
        except SchemaError:
            refused += 1
            survived += 1
            continue
        except Exception:
            continue
        try:  # accepted: it must be storable
            table = TABLE_FOR[type(rec)]
            encode_py(Plan.of(table), [rec])
            survived += decode(encode(rec)) == rec
        except Exception:
            pass
    return Row("codec: hostile lines", len(lines), survived, 0, 0, f"{refused:,} refused")


def agent_row(lines: list[bytes], workdir: Path) -> Row:
    from producers.agent import NodeAgent
    from schemas.config import AgentSettings
    from schemas.topics import Topics

    agent = NodeAgent(
        AgentSettings(job="j", node="n"), {"bootstrap.servers": "127.0.0.1:1"}, Topics(), workdir
    )
    try:
        taken = 0
        for i in range(0, len(lines), 200):
            taken += agent.accept(lines[i : i + 200])
        wanted = sum(1 for x in lines if x.strip())
        note = f"{agent.health.refused:,} as dead letters"
        return Row("agent: lines on its socket", wanted, taken, wanted - taken, 0, note)
    finally:
        agent.spool.close()


def spool_row(rng: random.Random, trials: int, workdir: Path) -> Row:
    from producers.spool import Spool

    base = workdir / "spool"
    n = 2000
    sp = Spool(base, max_bytes=16 << 20, segment_bytes=16 << 10)
    sp.append([f'{{"record":{i}}}'.encode() for i in range(n)])
    sp.close()
    survived = unsaid = counted = 0
    for t in range(trials):
        work = workdir / f"t{t}"
        shutil.copytree(base, work)
        segs = sorted(work.glob("*.seg"))
        seg = rng.choice(segs)
        data = bytearray(seg.read_bytes())
        how = rng.random()
        if how < 0.6:
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            seg.write_bytes(bytes(data))
        elif how < 0.9:
            seg.write_bytes(bytes(data[: rng.randrange(len(data))]))
        elif seg != segs[-1]:
            seg.unlink()
        try:
            again = Spool(work, max_bytes=16 << 20, segment_bytes=16 << 10)
            got = len(again.read(10 * n))
            again.close()
        except Exception:
            shutil.rmtree(work)
            continue
        survived += 1
        counted += again.lost
        unsaid += max(0, n - got - again.lost)
        shutil.rmtree(work)
    note = f"{counted:,} records lost to the damage, each counted"
    return Row("spool: bytes flipped, cut, deleted", trials, survived, unsaid, 0, note)


def webhook_row() -> Row:
    from detectors.alerting import AlertGate
    from flows.webhooks import WebhookDelivery
    from schemas.config import load_settings
    from schemas.enums import Cause, VerdictKind, VerdictStatus
    from schemas.results import Verdict

    calls = [0]
    hang = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            calls[0] += 1
            if calls[0] > 6:
                hang.wait(30)  # then it sits on every request
            self.send_response(503 if calls[0] % 2 else 200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    hooks = [{"name": "bench", "url": f"http://127.0.0.1:{server.server_port}/hook",
              "timeout_s": 1, "max_retries": 2, "backoff_s": 0.05}]  # fmt: skip
    alerts = load_settings(overrides={"alerts": {"webhooks": hooks, "queue_size": 4}}).alerts
    delivery = WebhookDelivery(alerts)
    gate = AlertGate(alerts)
    n = 20
    for i in range(n):
        v = Verdict(
            job="j", verdict_id=f"v{i}", status=VerdictStatus.OPEN, kind=VerdictKind.HANG,
            cause=Cause.COMPUTE, rank=i, onset_ns=0, detected_ns=i, severity=1.0,
        )  # fmt: skip
        for a in gate.update(v):
            delivery.submit(a)
    t0 = time.monotonic()
    delivery.wait_idle(3)
    delivery.close(3)
    took = time.monotonic() - t0
    hang.set()
    server.shutdown()
    s = delivery.stats()["bench"]
    unsaid = n - s.delivered - s.failed - s.dropped
    note = (
        f"{s.delivered} delivered, {s.failed} given up, {s.dropped} dropped (each logged); "
        f"shutdown {took:.1f} s"
    )
    return Row("webhook: failing, then hanging", n, n - max(0, unsaid), max(0, unsaid), 0, note)


# --------------------------------------------------------------------------- flows


_READ = """
import json, sys
from infra.clickhouse import connect
c = connect(sys.argv[1]); db = sys.argv[2]
out = {}
for t in sys.argv[3:]:
    raw = c.query(f"SELECT count() FROM {db}.{t}").result_rows[0][0]
    final = c.query(f"SELECT count() FROM {db}.{t} FINAL").result_rows[0][0]
    out[t] = [raw, final]
print(json.dumps(out))
"""


def _read_counts(url: str, db: str, tables: list[str]) -> dict[str, list[int]]:
    out = subprocess.run(
        [sys.executable, "-c", _READ, url, db, *tables],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cmd(settings: Settings, bootstrap: str, prefix: str, url: str, state: Path) -> list[str]:
    return [
        sys.executable, "-m", "megatrace", "--bootstrap-servers", bootstrap, "--topic-prefix",
        prefix, "--clickhouse-url", url, "--database", "faults", "--retention-days", "0",
        "--state-dir", str(state),
    ]  # fmt: skip


def flow_rows(
    settings: Settings, rng: random.Random, kills: int, pills: int, say: Say
) -> list[Row]:
    from collections import Counter

    from infra.kafka import delete_topics, ensure_topics, producer_config
    from infra.stack import Stack
    from producers.publish import KafkaPublisher
    from producers.sim.scenarios import build
    from schemas.tables import TABLE_FOR
    from schemas.topics import Topics

    stack = Stack(settings)
    _, started = stack.up()
    rows: list[Row] = []
    work = Path(tempfile.mkdtemp(prefix="megatrace-faults-"))
    try:
        boot = stack.bootstrap()
        for name in ("pills", "kills"):
            prefix = f"faults{time.time_ns() % 10**9}{name}."
            topics = Topics(prefix=prefix)
            ensure_topics(settings.kafka, boot, topics)
            pub = KafkaPublisher(producer_config(settings.kafka, boot), topics)
            run = build("story", scale="demo", seed=rng.randrange(1000), steps=24)
            records = list(run.records())
            bad = hostile_lines(rng, pills if name == "pills" else 0)
            cuts = sorted(rng.randrange(len(records)) for _ in bad)
            j = 0
            for i, rec in enumerate(records):
                while j < len(cuts) and cuts[j] == i:
                    pub.publish_raw(topics.inputs[j % len(topics.inputs)], b"x", bad[j])
                    j += 1
                pub.publish(rec)
            pub.flush()
            url = f"chdb://{work / name / 'ch'}"
            cmd = _cmd(settings, boot, prefix, url, work / name / "state")
            subprocess.run([*cmd, "db", "init"], check=True, capture_output=True, timeout=300)
            flow = [*cmd, "run", "--once", "--quiet"]
            if name == "kills":
                flow += ["--recovery-dir", str(work / name / "rec"), "--snapshot-s", "0.3"]
            survived = _run_killed(flow, rng, kills if name == "kills" else 0)
            expected = Counter(TABLE_FOR[type(r)].name for r in records)
            got = _read_counts(url, "faults", [*sorted(expected), "dead_letters"])
            lost = sum(max(0, n - got[t][1]) for t, n in expected.items())
            dupes = sum(got[t][0] - got[t][1] for t in expected)
            if name == "pills":
                dead = got["dead_letters"][1]
                rows.append(Row(f"flow: poison pills among {len(records):,} records", len(bad),
                                survived * len(bad), lost, dupes,
                                f"{dead:,} dead letters"))  # fmt: skip
            else:
                rows.append(Row(f"flow: kill -9 at random points, {len(records):,} records",
                                kills, survived * kills, lost, dupes,
                                "duplicates: rows written twice by the replays, merged away "
                                "by the tables (read with FINAL: 0)"))  # fmt: skip
            say(_format([rows[-1]])[-1])
            delete_topics(settings.kafka, boot, topics)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if started:
            stack.down()
    return rows


def _run_killed(flow: list[str], rng: random.Random, kills: int) -> int:
    """Run the flow to its end, killed ``kills`` times at random points first; 1 if it
    then finished cleanly."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for _ in range(kills):
        p = subprocess.Popen(flow, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        time.sleep(rng.uniform(1.0, 6.0))
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
        p.wait(30)
    done = subprocess.run(flow, capture_output=True, timeout=900, env=env)
    return int(done.returncode == 0)


# --------------------------------------------------------------------------- the table


def _format(rows: list[Row]) -> list[str]:
    head = ("fault", "tried", "survived", "lost", "duplicates", "")
    cells = [head] + [
        (r.fault, f"{r.tried:,}", f"{r.survived:,}", f"{r.lost:,}", str(r.duplicates), r.note)
        for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(5)]
    return [
        "  ".join(
            [c[0].ljust(widths[0]), *(c[i].rjust(widths[i]) for i in range(1, 5)), c[5]]
        ).rstrip()
        for c in cells
    ]


def faults(
    settings: Settings, *, lines: int, spool_trials: int, kills: int, pills: int, seed: int,
    say: Say,
) -> list[Row]:  # fmt: skip
    """Run every row (see the module docstring) and print the table as it fills."""
    rng = random.Random(seed)
    hostile = hostile_lines(rng, lines)
    rows: list[Row] = []
    say(_format([])[0])
    with tempfile.TemporaryDirectory(prefix="megatrace-faults-") as tmp:
        for make in (
            lambda: codec_row(hostile),
            lambda: agent_row(hostile, Path(tmp) / "agent"),
            lambda: spool_row(rng, spool_trials, Path(tmp)),
            webhook_row,
        ):
            rows.append(make())
            say(_format(rows)[-1])
    rows += flow_rows(settings, rng, kills, pills, say)
    return rows


__all__ = ["Row", "faults"]
