"""The NCCL profiler plugin, built here and driven through NCCL's own entry points
with ctypes (no GPU): records reach the node agent, decode with the schemas, and
`megatrace analyze` turns a slow link and a stuck proxy operation into verdicts."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from click.testing import CliRunner

from infra.kafka import producer_config
from megatrace.cli import cli
from producers.agent import NodeAgent
from producers.agent_client import AgentClient
from producers.host_cpu import cgroup_throttled, process_cpu
from producers.nccl_plugin import P2P, Plugin
from schemas.codec import decode, write_jsonl
from schemas.config import Settings
from schemas.enums import CommRole
from schemas.records import (
    Collective,
    CommInfo,
    Heartbeat,
    JobInfo,
    LinkSample,
    ProxySummary,
    RankInfo,
)
from schemas.topics import Topics
from tests.helpers import consume_all, latest_verdicts, wait_until_delivered

COMM = 0x5EED_C0FFEE


@pytest.fixture
def library(tmp_path: Path) -> Path:
    res = CliRunner().invoke(cli, ["build-plugin", "--out", str(tmp_path / "build")])
    assert res.exit_code == 0, res.output
    return Path(res.output.splitlines()[0])


@pytest.fixture
def receiver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A bare datagram socket where the agent would listen."""
    path = tmp_path / "agent.sock"
    monkeypatch.setenv("MEGATRACE_AGENT__SOCKET", str(path))
    monkeypatch.setenv("MEGATRACE_JOB", "plugin-job")
    monkeypatch.setenv("MEGATRACE_STUCK_MS", "200")
    monkeypatch.setenv("MEGATRACE_HEARTBEAT_MS", "100")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(path))
    s.settimeout(0.3)
    yield s
    s.close()


def received(s: socket.socket, seconds: float = 1.0) -> list[Any]:
    """Everything that arrives within ``seconds`` (heartbeats keep coming)."""
    data = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(TimeoutError):
            data += s.recv(1 << 16)
    return [decode(line) for line in data.split(b"\n") if line.strip()]


@pytest.mark.parametrize("version", [7, 6, 5, 4])
def test_a_multi_rank_collective_arrives_whole(
    library: Path, receiver: socket.socket, version: int
) -> None:
    plugin = Plugin(library, version)
    comms = [plugin.init(COMM, 4, r) for r in range(4)]
    for seq in range(3):
        plugin.collective(comms, seq, channels=2, steps=4, step_bytes=1 << 16)
    plugin.flush()
    records = received(receiver)
    colls = [r for r in records if isinstance(r, Collective)]
    assert sorted((c.seq, c.rank) for c in colls) == [(s, r) for s in range(3) for r in range(4)]
    c = colls[0]
    assert (c.comm_hash, c.comm_size, c.op.value, c.dtype.value, c.algo, c.nchannels) == (
        COMM, 4, "AllReduce", "bfloat16", "RING", 2,
    )  # fmt: skip
    # the GPU reached the call when its first kernel channel started
    assert all(c.enqueue_ns <= c.start_ns <= c.end_ns for c in colls)
    proxies = [r for r in records if isinstance(r, ProxySummary)]
    assert len(proxies) == 3 * 4 * 2 * 2  # seq x rank x channel x direction
    assert all(p.steps_done == p.steps_posted == 4 for p in proxies)
    assert all(p.size_bytes == 4 << 16 for p in proxies)
    sends = [p for p in proxies if p.direction.value == "send"]
    assert {(p.rank, p.peer) for p in sends} == {(0, 1), (1, 2), (2, 3), (3, 0)}
    assert all(p.send_wait_ns > 0 and p.send_gpu_wait_ns > 0 for p in sends)
    beats = [r for r in records if isinstance(r, Heartbeat)]
    assert beats
    # the process's CPU counters, where the kernel keeps them (read here as the plugin does)
    if process_cpu() is not None:
        assert all(b.cpu_ns and b.cpu_wait_ns is not None for b in beats)
    # its CPU cgroups' throttled time, where readable (the plugin's C reading and the
    # Python one find the same groups: both absent, or the plugin's none newer)
    held = cgroup_throttled()
    if held is None:
        assert all(b.cpu_throttled_ns is None for b in beats)
    else:
        assert all(b.cpu_throttled_ns is not None and b.cpu_throttled_ns <= held for b in beats)
    for comm in comms:
        plugin.finalize(comm)
    events, sent, dropped = plugin.stats()
    assert events > 0
    assert dropped == 0 and sent >= len(colls) + len(proxies)
    counts = plugin.counts()
    assert counts["calls_finished"] == len(colls) and counts["calls_reported_stuck"] == 0


def test_every_profiler_api_version_is_exported_newest_first(library: Path) -> None:
    """NCCL takes the newest interface it knows: 2.31 takes v7, 2.29 v6, 2.28 v5."""
    import ctypes

    from producers.nccl_plugin import VERSIONS

    lib = ctypes.CDLL(str(library))
    assert VERSIONS == (7, 6, 5, 4)
    for v in VERSIONS:
        assert ctypes.c_void_p.in_dll(lib, f"ncclProfiler_v{v}")


def test_v7_kernel_phases_tags_and_variants_are_recorded(
    library: Path, receiver: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With MEGATRACE_KERNEL_PHASES=1 the plugin asks v7 for the kernel's phases: each
    call records the longest initial sync, data movement and final sync of its channels,
    the GPU's own measure of how long it waited and how long the transfer took."""
    from producers.nccl_plugin import KERNEL_PHASE

    monkeypatch.setenv("MEGATRACE_KERNEL_PHASES", "1")
    plugin = Plugin(library, 7)
    comms = [plugin.init(COMM, 2, r) for r in range(2)]
    assert plugin.mask & KERNEL_PHASE
    phases = {0: (900_000, 40_000, 5_000), 1: (1_000, 41_000, 6_000)}  # rank 1 came last
    plugin.collective(comms, 0, channels=2, user_tag=0xBEEF, phases_ns=phases)
    plugin.flush()
    colls = sorted((r for r in received(receiver) if isinstance(r, Collective)),
                   key=lambda c: c.rank)  # fmt: skip
    assert [(c.gpu_sync_ns, c.gpu_move_ns, c.gpu_final_sync_ns) for c in colls] == [
        phases[0], phases[1]]  # fmt: skip
    assert {c.user_tag for c in colls} == {0xBEEF}
    assert {c.kernel_variant for c in colls} == {"AllReduce_RING_SIMPLE"}
    assert plugin.counts()["kernel_phases_started"] == 2 * 2 * 3  # ranks x channels x phases
    for comm in comms:
        plugin.finalize(comm)


def test_v7_asks_for_no_kernel_phases_by_default(library: Path) -> None:
    from producers.nccl_plugin import CE_COLL, KERNEL_CH, KERNEL_PHASE

    plugin = Plugin(library, 7)
    comm = plugin.init(COMM, 2, 0)
    assert plugin.mask & KERNEL_CH and plugin.mask & CE_COLL
    assert not plugin.mask & KERNEL_PHASE
    plugin.finalize(comm)


@pytest.mark.parametrize("version", [6, 7])
def test_a_copy_engine_collective_is_a_collective(
    library: Path, receiver: socket.socket, version: int
) -> None:
    plugin = Plugin(library, version)
    comms = [plugin.init(COMM, 2, r) for r in range(2)]
    plugin.ce_collective(comms, 5)
    plugin.flush()
    colls = [r for r in received(receiver) if isinstance(r, Collective)]
    assert sorted((c.rank, c.seq, c.op.value, c.algo) for c in colls) == [
        (0, 5, "AllGather", "CE"), (1, 5, "AllGather", "CE")]  # fmt: skip
    assert all(c.enqueue_ns <= c.end_ns for c in colls)
    counts = plugin.counts()
    assert counts["ce_colls_started"] == 2 and counts["ce_parts_started"] == 4
    for comm in comms:
        plugin.finalize(comm)


def test_a_slow_edge_and_a_stuck_proxy_op_show_in_the_records(
    library: Path, receiver: socket.socket
) -> None:
    plugin = Plugin(library)
    comms = [plugin.init(COMM, 2, r) for r in range(2)]
    plugin.collective(comms, 0, send_wait_s={(0, 1): 0.004, (1, 0): 0.0004})
    plugin.collective(comms, 1, stuck=(0, 1))
    time.sleep(0.4)  # past MEGATRACE_STUCK_MS
    plugin.flush()
    records = received(receiver)
    links = {
        (r.src_rank, r.dst_rank): r.throughput_gbps for r in records if isinstance(r, LinkSample)
    }
    assert links[(0, 1)] < 0.5 * links[(1, 0)]
    stuck = [
        r
        for r in records
        if isinstance(r, ProxySummary) and r.seq == 1 and r.steps_done < r.steps_posted
    ]
    assert {(p.rank, p.peer, p.direction.value) for p in stuck} == {(0, 1, "send"), (1, 0, "recv")}
    unfinished = [r for r in records if isinstance(r, Collective) and r.seq == 1]
    assert len(unfinished) == 2 and all(c.end_ns is None for c in unfinished)
    assert all(c.start_ns is not None for c in unfinished)  # on the GPU, never finished
    for comm in comms:
        plugin.finalize(comm)


def test_a_transfer_to_itself_is_counted_and_never_reported_stuck(
    library: Path, receiver: socket.socket
) -> None:
    # NCCL 2.28.9 (seen by `megatrace gpu-check` on an H200) runs a rank's send and
    # receive to itself with no proxy operation: no event ever says they ended.
    plugin = Plugin(library)
    comm = plugin.init(COMM, 2, 0)
    for func in ("Send", "Recv"):
        handle = plugin.start(
            comm, P2P, func=func, count=256, datatype="ncclFloat32", peer=0, nChannels=1
        )
        plugin.stop(handle)
    time.sleep(0.4)  # past MEGATRACE_STUCK_MS
    plugin.flush()
    assert not [r for r in received(receiver) if isinstance(r, Collective)]
    counts = plugin.counts()
    assert counts["p2p_started"] == counts["self_transfers_skipped"] == 2
    assert counts["calls_reported_stuck"] == 0
    plugin.finalize(comm)


def test_a_burst_beyond_the_agents_socket_queue_is_not_lost(
    library: Path, receiver: socket.socket
) -> None:
    """The agent's socket queues ~10 datagrams; datagrams sent faster than a busy agent
    reads them (one every 30 ms here) all arrive: the plugin's flusher waits for room
    instead of dropping."""
    data: list[bytes] = []
    stop = threading.Event()

    def busy_agent() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                data.append(receiver.recv(1 << 16))
            time.sleep(0.03)

    reader = threading.Thread(target=busy_agent)
    reader.start()
    plugin = Plugin(library)
    comms = [plugin.init(COMM, 2, r) for r in range(2)]
    for seq in range(400):  # about 40 datagrams, in bursts as the flusher wakes
        plugin.collective(comms, seq, channels=2, steps=4, step_bytes=1 << 16)
    plugin.flush()
    dropped = plugin.stats()[2]

    def calls() -> list[Collective]:
        lines = [line for d in list(data) for line in d.split(b"\n") if b'"coll"' in line]
        return [r for r in map(decode, lines) if isinstance(r, Collective)]

    deadline = time.monotonic() + 20
    while len(colls := calls()) < 800 and time.monotonic() < deadline:
        time.sleep(0.1)
    stop.set()
    reader.join()
    assert dropped == 0 and sorted((c.seq, c.rank) for c in colls) == [
        (s, r) for s in range(400) for r in range(2)
    ]
    for comm in comms:
        plugin.finalize(comm)


def test_the_plugin_never_blocks_without_an_agent(
    library: Path, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("MEGATRACE_AGENT__SOCKET", str(tmp_path / "nobody.sock"))
    plugin = Plugin(library)
    comms = [plugin.init(COMM, 2, r) for r in range(2)]
    t0 = time.monotonic()
    for seq in range(50):
        plugin.collective(comms, seq)
    plugin.flush()
    assert time.monotonic() - t0 < 10
    _, sent, dropped = plugin.stats()
    # every record counted as dropped: per collective one call per rank and a proxy op
    # per rank, channel and direction (the flusher thread may be sending when flush()
    # is called: flush waits for it, so none is still on its way)
    assert sent == 0 and dropped >= 50 * (2 + 2 * 2 * 2)
    for comm in comms:
        plugin.finalize(comm)


# --------------------------------------------------------------------------- analyze


def _job_records(hosts: list[str]) -> list[Any]:
    """What the PyTorch collector declares for this 2-rank tensor-parallel job."""
    return [
        JobInfo(job="plugin-job", ts_ns=time.time_ns(), world_size=2, tp=2, num_layers=1),
        *(
            RankInfo(
                job="plugin-job",
                ts_ns=time.time_ns(),
                rank=r,
                node=hosts[r],
                gpu=r,
                nic=f"mlx5_{r}",
            )
            for r in range(2)
        ),
        CommInfo(
            job="plugin-job", ts_ns=time.time_ns(), comm_hash=COMM, role=CommRole.TP, ranks=[0, 1]
        ),
    ]


def _through_agent(settings: Settings, tmp_path: Path, drive) -> list[Any]:
    """Run the node agent, let ``drive`` send to it, then read back what it published."""
    sock = tmp_path / "agent.sock"
    agent_settings = msgspec.structs.replace(
        settings.agent, socket=str(sock), spool_dir=str(tmp_path / "spool"), node="gpu-node-0"
    )
    topics = Topics(prefix=settings.kafka.topic_prefix)
    agent = NodeAgent(
        agent_settings,
        producer_config(settings.kafka, settings.kafka.bootstrap_servers),
        topics,
        tmp_path,
    )
    agent.start()
    try:
        while not sock.exists():
            time.sleep(0.01)
        drive(sock)
        wait_until_delivered(agent)
    finally:
        agent.stop()
    h = agent.snapshot()
    assert h.refused == 0 and h.dropped == 0 and h.delivered == h.accepted
    out: list[Any] = []
    for topic in topics.inputs:
        out += [decode(m.value()) for m in consume_all(settings, topic, 10**9, timeout_s=1.5)]
    return sorted(out, key=lambda r: getattr(r, "ts_ns", None) or getattr(r, "enqueue_ns", 0))


def _analyze(records: list[Any], tmp_path: Path) -> list[dict]:
    path = tmp_path / "plugin.jsonl"
    write_jsonl(path, records)
    res = CliRunner().invoke(cli, ["analyze", str(path), "--json"])
    assert res.exit_code == 0, res.output
    return latest_verdicts(res.output)


@pytest.mark.integration
@pytest.mark.parametrize("version", [7, 5])
def test_analyze_names_the_slow_link_and_the_stuck_edge(
    library: Path, settings: Settings, tmp_path: Path, monkeypatch, version: int
) -> None:
    monkeypatch.setenv("MEGATRACE_STUCK_MS", "200")
    monkeypatch.setenv("MEGATRACE_HEARTBEAT_MS", "100")
    monkeypatch.delenv("MEGATRACE_JOB", raising=False)  # the agent stamps job and node
    monkeypatch.setenv("MEGATRACE_AGENT__JOB", "plugin-job")

    def drive(sock: Path) -> None:
        monkeypatch.setenv("MEGATRACE_AGENT__SOCKET", str(sock))
        AgentClient(sock).send(_job_records(["gpu-node-0", "gpu-node-1"]))
        plugin = Plugin(library, version)
        comms = [plugin.init(COMM, 2, r) for r in range(2)]
        normal = {(0, 1): 0.002, (1, 0): 0.002}
        slow = {(0, 1): 0.02, (1, 0): 0.002}  # the 0 -> 1 link runs 10x slower from step 12
        seq = 0
        for step in range(24):
            for _ in range(4):  # 4 tensor-parallel all-reduces per step
                plugin.collective(comms, seq, steps=2, send_wait_s=slow if step >= 12 else normal)
                seq += 1
        plugin.collective(comms, seq, steps=2, stuck=(0, 1))  # then the 0 -> 1 transfer hangs
        time.sleep(1.5)
        plugin.flush()
        for comm in comms:
            plugin.finalize(comm)

    records = _through_agent(
        msgspec.structs.replace(
            settings, agent=msgspec.structs.replace(settings.agent, job="plugin-job")
        ),
        tmp_path,
        drive,
    )
    assert all(getattr(r, "job", "plugin-job") == "plugin-job" for r in records)
    found = _analyze(records, tmp_path)
    # SendWait comes from real 1-2 ms sleeps here: under load a healthy edge can look slow
    # too, so the test asks for the slow edge among the link verdicts, not for it alone
    links = [v["link"] for v in found if v["kind"] == "link_degradation"]
    assert any(x.startswith("gpu-node-0") and "gpu-node-1" in x for x in links), links
    verdicts = {v["kind"]: v for v in found}
    hang = verdicts["hang"]
    assert hang["cause"] in ("network_link", "nic")
    assert "gpu-node-0" in (hang["link"] or "") and "gpu-node-1" in (hang["link"] or "")
