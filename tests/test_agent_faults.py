"""The node agent and its spool under faults: damage on disk, bad lines, small bounds,
a second agent. Every accepted record is delivered or counted as lost, and the agent
says what is happening."""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from megatrace.cli import cli
from producers.agent import NodeAgent
from producers.agent_client import AgentClient
from producers.agent_publish import unpack
from producers.spool import Spool, SpoolError
from producers.spool_frames import FRAME_MARK
from schemas.codec import decode
from schemas.config import AgentSettings
from schemas.records import DeadLetter
from schemas.topics import Topics

N = 400


def _filled(tmp_path: Path) -> tuple[Path, list[bytes]]:
    """A closed spool of N records over several segments."""
    d = tmp_path / "spool"
    sp = Spool(d, max_bytes=1 << 20, segment_bytes=4096)
    items = [f'{{"record":{i},"pad":"{"x" * (i % 37)}"}}'.encode() for i in range(N)]
    assert sp.append(items) == N
    sp.close()
    assert len(list(d.glob("*.seg"))) >= 4
    return d, items


def _read_all(d: Path) -> tuple[list[bytes], int]:
    lost: list[tuple[str, int]] = []
    sp = Spool(d, max_bytes=1 << 20, segment_bytes=4096, on_loss=lambda w, n: lost.append((w, n)))
    got = [p for p, _ in sp.read(10 * N)]
    assert sp.lost == sum(n for _, n in lost)
    sp.close()
    return got, sp.lost


def test_one_flipped_byte_anywhere_costs_at_most_the_record_it_hit(tmp_path: Path) -> None:
    """At 300 random offsets over every segment: the spool opens, reads everything that
    is intact in order, and counts what it could not read; nothing is lost unsaid."""
    d, items = _filled(tmp_path)
    rng = random.Random(7)
    segs = sorted(d.glob("*.seg"))
    for trial in range(300):
        work = tmp_path / f"t{trial}"
        shutil.copytree(d, work)
        seg = work / rng.choice(segs).name
        data = bytearray(seg.read_bytes())
        at = rng.randrange(len(data))
        data[at] ^= 1 << rng.randrange(8)
        seg.write_bytes(bytes(data))
        got, lost = _read_all(work)
        assert got == [x for x in items if x in set(got)], "in order, and intact"
        assert len(got) + lost == N, (trial, seg.name, at, len(got), lost)
        assert lost <= 1
        shutil.rmtree(work)


def test_a_segment_cut_short_or_deleted_is_counted_exactly(tmp_path: Path) -> None:
    d, items = _filled(tmp_path)
    segs = sorted(d.glob("*.seg"))
    rng = random.Random(3)
    for trial in range(40):
        work = tmp_path / f"c{trial}"
        shutil.copytree(d, work)
        older = work / rng.choice(segs[:-1]).name  # fully written and synced
        if trial % 4 == 0:
            older.unlink()
        else:
            data = older.read_bytes()
            older.write_bytes(data[: rng.randrange(len(data))])
        got, lost = _read_all(work)
        assert got == [x for x in items if x in set(got)]
        assert len(got) + lost == N, (trial, older.name, len(got), lost)
        shutil.rmtree(work)


def test_a_torn_last_write_is_cut_and_the_spool_goes_on(tmp_path: Path) -> None:
    d, items = _filled(tmp_path)
    last = sorted(d.glob("*.seg"))[-1]
    data = last.read_bytes()
    cut = data.rindex(FRAME_MARK) + 7  # the process died while writing the last record
    last.write_bytes(data[:cut])
    sp = Spool(d, max_bytes=1 << 20, segment_bytes=4096)
    sp.append([b"after"])
    got = [p for p, _ in sp.read(10 * N)]
    assert got == [*items[:-1], b"after"] and sp.lost == 1  # received, not kept: said


def test_a_small_spool_with_the_broker_up_never_fills(tmp_path: Path) -> None:
    """A 1 MiB bound holds what is undelivered, not what was delivered: 20,000 records
    (4 MB) through it, delivered as they come, drop nothing and the disk stays small."""
    sp = Spool(tmp_path, max_bytes=1 << 20)
    record = b'{"type":"hb","job":"j","node":"n","rank":1,"ts_ns":1,"pad":"' + b"x" * 140 + b'"}'
    biggest = 0
    for _ in range(2000):
        assert sp.append([record] * 10) == 10
        batch = sp.read(100)
        sp.commit(batch[-1][1])
        biggest = max(biggest, sp.size_bytes)
    assert sp.dropped == 0 and sp.pending() == 0
    assert biggest <= (1 << 20) + sp.segment_bytes


def test_two_agents_cannot_share_a_spool(tmp_path: Path) -> None:
    first = Spool(tmp_path, max_bytes=1 << 20)
    with pytest.raises(SpoolError, match=r"in use by another agent \(pid \d+\)"):
        Spool(tmp_path, max_bytes=1 << 20)
    first.close()
    Spool(tmp_path, max_bytes=1 << 20).close()  # free again once the first one closed


def test_a_spool_bound_of_zero_is_one_clear_line() -> None:
    res = CliRunner().invoke(cli, ["agent", "--spool-max-mb", "0"])
    assert res.exit_code == 2 and "--spool-max-mb" in res.output
    assert "Traceback" not in res.output
    res = CliRunner().invoke(cli, ["config", "show"], env={"MEGATRACE_AGENT__SPOOL_MAX_MB": "0"})
    assert res.exit_code == 2 and "spool_max_mb must be at least 1" in res.output


def test_the_agent_defaults_live_in_the_state_directory(tmp_path: Path) -> None:
    agent = NodeAgent(AgentSettings(), {"bootstrap.servers": "127.0.0.1:1"}, Topics(), tmp_path)
    try:
        s = agent.settings
        assert Path(s.socket) == tmp_path / "agent.sock"
        assert Path(s.spool_dir) == tmp_path / "spool"
        assert Path(s.health_file) == tmp_path / "agent-health.json"
    finally:
        agent.spool.close()


def _agent(tmp_path: Path) -> NodeAgent:
    # a broker nobody answers on: the agent takes and spools, it cannot deliver
    return NodeAgent(
        AgentSettings(job="j", node="n0", health_interval_s=0.2),
        {"bootstrap.servers": "127.0.0.1:1"},
        Topics(),
        tmp_path,
    )


def test_the_socket_keeps_listening_after_any_bad_line(tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    agent.start()
    try:
        client = AgentClient(agent.settings.socket)
        deep = b"[" * 10_000 + b"]" * 10_000
        bad = [
            b'{"type":"hb","rank":0,"ts_ns":1,"x":' + deep + b"}",
            b'{"type":[1],"job":"j"}',
            b'{"type":"label","job":"j","fault_id":"f","kind":"hang","cause":"compute",'
            b'"onset_step":1,"onset_ns":1}',
            b'{"type":"verdict","job":"j","verdict_id":"x","kind":"hang","cause":"compute",'
            b'"onset_ns":1,"detected_ns":1}',
        ]
        for line in bad:
            client.send_lines([line])
        client.send_lines([b'{"type":"hb","rank":3,"ts_ns":5}'])  # stamped with job, node
        deadline = time.monotonic() + 10
        while agent.snapshot().accepted < len(bad) + 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        h = agent.write_health()
        assert (h.accepted, h.refused) == (len(bad) + 1, len(bad))
        assert Path(agent.settings.socket).exists() and h.healthy
        assert json.loads(Path(agent.settings.health_file).read_text())["healthy"] is True
        agent.stop(drain_s=0.2)  # nothing delivered: all of it is still in the spool
        spool = Spool(agent.settings.spool_dir, max_bytes=1 << 20)
        frames = [unpack(p) for p, _ in spool.read(100)]
        spool.close()
        reasons = [decode(v).reason.value for t, _, v in frames if t == Topics().deadletter]
        assert reasons == ["malformed", "unknown_type", "not_an_input", "not_an_input"]
        (good,) = [decode(v) for t, _, v in frames if t == Topics().heartbeat]
        assert (good.job, good.node, good.rank) == ("j", "n0", 3)
        assert not any(
            isinstance(decode(v), DeadLetter) for t, _, v in frames if t != Topics().deadletter
        )
    finally:
        agent.stop(drain_s=0.5)


def test_damage_in_the_spool_is_counted_and_the_agent_stays_up(tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    lines = [f'{{"type":"hb","rank":{i % 8},"ts_ns":{i + 1}}}'.encode() for i in range(500)]
    assert agent.accept(lines) == 500
    agent.spool.close()
    seg = sorted((tmp_path / "spool").glob("*.seg"))[-1]
    data = bytearray(seg.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one record in the middle of the newest segment
    seg.write_bytes(bytes(data))
    again = _agent(tmp_path)
    got = again.spool.read(1000)
    h = again.snapshot()
    assert len(got) == 499 and h.lost == 1 and "damaged" in h.last_error
    again.spool.close()
