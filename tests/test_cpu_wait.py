"""Ranks starved of CPU: the producer's counters (read under a real CPU quota where the
machine allows) and the detector's reading of them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import numpy as np
import pytest

from detectors.cpu_wait import CpuWaits, cpu_bound, starved
from infra.netlab import NetLab
from producers.host_cpu import cgroup_throttled, process_cpu

NODES = ["n0", "n0", "n1", "n1", "n2", "n2", "n3", "n3"]
S = 10**9


def _waits(shares_before: list[float], shares_after: list[float], seed: int = 0) -> CpuWaits:
    """Heartbeats every 0.25 s for 10 s; each rank's wait share, with noise, is
    ``shares_before[r]`` until t=5 s and ``shares_after[r]`` from then."""
    rng = np.random.default_rng(seed)
    cpu = CpuWaits()
    for r, (b, a) in enumerate(zip(shares_before, shares_after, strict=True)):
        waited = 0.0
        for i in range(41):
            t = i * 0.25
            if i:
                level = b if t <= 5 else a
                waited += max(0.0, level * (1 + 0.3 * rng.standard_normal())) * 0.25
            cpu.update(r, int(t * S) + r * 1000, int(waited * S))
    return cpu


def test_a_rank_starved_of_cpu_is_named_not_the_peers_it_holds_up() -> None:
    # the others wait for it blocked (in a socket or for the GPU), not for a CPU
    cpu = _waits([0.6] * 8, [0.2, 1.8, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2])
    (got,) = starved(cpu, 5 * S, 10 * S, NODES)
    assert got.ranks == (1,) and got.node is None
    assert got.share > 1.2 and got.usual < 0.4


def test_every_rank_of_a_node_starved_is_its_host() -> None:
    cpu = _waits([0.6] * 8, [0.3, 0.3, 0.3, 0.3, 1.6, 1.9, 0.3, 0.3])
    (got,) = starved(cpu, 5 * S, 10 * S, NODES)
    assert (got.node, sorted(got.ranks)) == ("n2", [4, 5])


def test_a_slow_network_starves_nobody() -> None:
    # every rank blocks in its transfers: their waits for a CPU drop together
    cpu = _waits([0.6] * 8, [0.05] * 8)
    assert starved(cpu, 5 * S, 10 * S, NODES) == ()


def test_a_crowded_host_keeps_every_rank_from_a_cpu_a_slow_network_puts_them_to_sleep() -> None:
    """What tells slower transfers of the network from those of ranks that got less CPU
    (:func:`~detectors.cpu_wait.cpu_bound`): every rank kept waiting as long as before or
    longer is crowded out; every rank waiting less sleeps in its transfers."""
    crowded = _waits([0.75] * 8, [0.85] * 8)
    assert cpu_bound(crowded, range(8), 5 * S, 10 * S)
    asleep = _waits([0.65] * 8, [0.3] * 8)  # the lab's slow link beside Megatron's ranks
    assert not cpu_bound(asleep, range(8), 5 * S, 10 * S)
    # ranks that seldom wait for a CPU (a GPU job's) are not crowded out whatever happens
    idle = _waits([0.05] * 8, [0.08] * 8)
    assert not cpu_bound(idle, range(8), 5 * S, 10 * S)
    # shares not known (no heartbeat counters, or not yet): nothing is said
    assert not cpu_bound(CpuWaits(), range(8), 5 * S, 10 * S)
    assert not cpu_bound(crowded, range(8), 20 * S, 21 * S)


def test_a_rank_starved_before_the_shift_is_not_what_changed() -> None:
    cpu = _waits([0.3, 1.8, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3], [0.3, 1.9, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3])
    assert starved(cpu, 5 * S, 10 * S, NODES) == ()


def test_noise_alone_starves_nobody() -> None:
    """Shares that wander as a crowded host's do (each rank its own level, 30% noise per
    beat, levels moving by up to 0.3 at the shift): nothing, over 200 jobs."""
    rng = np.random.default_rng(7)
    named = 0
    for seed in range(200):
        before = rng.uniform(0.2, 1.0, 8)
        after = np.clip(before + rng.uniform(-0.3, 0.3, 8), 0, None)
        named += bool(starved(_waits(before.tolist(), after.tolist(), seed), 5 * S, 10 * S, NODES))
    assert named == 0


def _held(waits: list[float], before: list[float], after: list[float], seed: int = 0) -> CpuWaits:
    """Heartbeats every 0.25 s for 10 s: each rank's wait share ``waits[r]`` all along, and
    its throttled share (with noise) ``before[r]`` until t=5 s and ``after[r]`` from then."""
    rng = np.random.default_rng(seed)
    cpu = CpuWaits()
    for r, (w, b, a) in enumerate(zip(waits, before, after, strict=True)):
        waited = held = 0.0
        for i in range(41):
            t = i * 0.25
            if i:
                waited += max(0.0, w * (1 + 0.3 * rng.standard_normal())) * 0.25
                level = b if t <= 5 else a
                held += max(0.0, level * (1 + 0.3 * rng.standard_normal())) * 0.25
            cpu.update(r, int(t * S) + r * 1000, int(waited * S), int(held * S))
    return cpu


def test_a_rank_its_quota_holds_back_beside_a_slow_link_is_named() -> None:
    """Behind a slow link every rank sleeps in its transfers and waits little for a CPU;
    the rank whose container quota holds it back a fifth of the time is named by the
    kernel's own account of it, its wait share no higher than a peer's."""
    waits = [0.05, 0.13, 0.04, 0.12, 0.05, 0.06, 0.05, 0.04]
    cpu = _held(waits, [0.0] * 8, [0, 0, 0, 0.21, 0, 0, 0, 0])
    (got,) = starved(cpu, 5 * S, 10 * S, NODES)
    assert got.ranks == (3,) and got.node is None
    assert got.throttled is not None and 0.15 < got.throttled < 0.3
    assert got.share < 0.3


def test_a_node_held_to_a_quota_is_its_host() -> None:
    # a quota on the node's group: both its ranks read the same throttled counter
    cpu = _held([0.1] * 8, [0.0] * 8, [0, 0, 0.4, 0.4, 0, 0, 0, 0])
    (got,) = starved(cpu, 5 * S, 10 * S, NODES)
    assert (got.node, sorted(got.ranks)) == ("n1", [2, 3])


def test_a_quota_that_always_held_a_rank_back_is_not_what_changed() -> None:
    # a container limit every step already met: its throttling is the job's normal
    cpu = _held([0.1] * 8, [0, 0.3, 0, 0, 0, 0, 0, 0], [0, 0.32, 0, 0, 0, 0, 0, 0])
    assert starved(cpu, 5 * S, 10 * S, NODES) == ()


def test_a_quota_holding_on_through_a_second_shift_is_not_what_changed_again() -> None:
    """A host held back 1.1 s a second by its quota since the first shift: at a second
    shift its ranks' throttled shares move as what they run does (one 1.25, one 1.2),
    which is not a new quota on one of its ranks."""
    cpu = _held([0.2] * 8, [0, 0, 0, 0, 0, 0, 1.1, 1.1], [0, 0, 0, 0, 0, 0, 1.25, 1.2])
    assert starved(cpu, 5 * S, 10 * S, NODES) == ()


def test_quotas_that_throttle_a_little_everywhere_name_nobody() -> None:
    """Every rank under a limit it sometimes meets (throttled 0 to 8% of the time, moving
    by up to 5 points at the shift, 30% noise per beat): nothing, over 200 jobs."""
    rng = np.random.default_rng(11)
    named = 0
    for seed in range(200):
        before = rng.uniform(0.0, 0.08, 8)
        after = np.clip(before + rng.uniform(-0.05, 0.05, 8), 0, None)
        cpu = _held(rng.uniform(0.2, 1.0, 8).tolist(), before.tolist(), after.tolist(), seed)
        named += bool(starved(cpu, 5 * S, 10 * S, NODES))
    assert named == 0


@pytest.mark.parametrize("held", [0.06, 0.08])
def test_a_rank_the_only_one_throttled_at_all_is_named_by_a_little_of_it(held: float) -> None:
    """A quota of its own, just under what the rank uses: throttled 6-8% of the time,
    and no other rank of the job throttled at all (the kernel's count is exact). Named;
    under limits that every rank meets now and then, the same share is not
    (``test_quotas_that_throttle_a_little_everywhere_name_nobody``)."""
    cpu = _held([0.5] * 8, [0.0] * 8, [0, held, 0, 0, 0, 0, 0, 0])
    (got,) = starved(cpu, 5 * S, 10 * S, NODES)
    assert got.ranks == (1,) and got.throttled is not None and got.throttled > 0.04
    everywhere = _held([0.5] * 8, [0.02] * 8, [0.02, held, 0.02, 0.02, 0.02, 0.02, 0.02, 0.02])
    assert starved(everywhere, 5 * S, 10 * S, NODES) == ()


def test_a_heartbeat_without_the_throttled_counter_is_not_a_quota() -> None:
    # a read that failed once keeps the last value: no jump when it comes back
    cpu = CpuWaits()
    for t, held in [(0, 0), (1, 100), (2, None), (3, 200)]:
        cpu.update(0, t * S, 0, None if held is None else held * 10**6)
    got = cpu.rates(0, 3 * S, throttled=True)[0]
    assert got == pytest.approx(0.2 / 3)


def test_too_many_starved_ranks_name_nobody() -> None:
    # three ranks on three nodes: not one host, and more than a quarter of the job
    cpu = _waits([0.4] * 8, [1.8, 0.3, 1.8, 0.3, 1.8, 0.3, 0.3, 0.3])
    assert starved(cpu, 5 * S, 10 * S, NODES) == ()


def test_without_the_counters_for_most_ranks_nothing_is_said() -> None:
    cpu = _waits([0.6] * 3, [0.2, 1.8, 0.2])  # ranks 3-7 never carried them
    assert starved(cpu, 5 * S, 10 * S, NODES) == ()


def test_a_counter_that_goes_down_adds_nothing() -> None:
    # a thread that ended takes its counts with it
    cpu = CpuWaits()
    for t, w in [(0, 0), (1, 500), (2, 100), (3, 600)]:
        cpu.update(0, t * S, w * 10**6)
    assert cpu.share(0, 0, 3 * S) == pytest.approx((0.5 + 0.0 + 0.5) / 3)


def test_the_producer_sums_its_threads_and_skips_one_that_ended(tmp_path: Path) -> None:
    for tid, text in [("1", "9000 400 7\n"), ("2", "1000 600 3\n"), ("3", None)]:
        (tmp_path / tid).mkdir()
        if text:
            (tmp_path / tid / "schedstat").write_text(text)
    assert process_cpu(str(tmp_path)) == (10000, 1000)
    assert process_cpu(str(tmp_path / "gone")) is None


def _cgroup_tree(tmp_path: Path, cgroup: str, mountinfo: str, stats: dict[str, str]) -> str:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text(mountinfo.replace("ROOT", str(tmp_path)))
    for where, text in stats.items():
        (tmp_path / where).mkdir(parents=True, exist_ok=True)
        (tmp_path / where / "cpu.stat").write_text(text)
    return str(proc)


def test_the_producer_sums_the_throttling_of_its_cgroup_and_those_above(tmp_path: Path) -> None:
    # cgroup v1 (a pod's limit and its container's), hybrid: the cpu controller is on v1
    proc = _cgroup_tree(
        tmp_path,
        "12:cpu,cpuacct:/kubepods/pod1/ctr\n0::/kubepods/pod1/ctr\n",
        "31 23 0:29 / ROOT/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
        "40 23 0:40 / ROOT/unified rw - cgroup2 cgroup2 rw\n",
        {
            "cpu,cpuacct": "nr_periods 0\nthrottled_time 0\n",
            "cpu,cpuacct/kubepods/pod1": "nr_throttled 3\nthrottled_time 5000\n",
            "cpu,cpuacct/kubepods/pod1/ctr": "nr_throttled 9\nthrottled_time 70000\n",
        },
    )
    assert cgroup_throttled(proc) == 75000


def test_the_producer_reads_cgroup_v2_in_a_container(tmp_path: Path) -> None:
    # the container's own group mounted as its cgroup tree: the group is the mount's root
    proc = _cgroup_tree(
        tmp_path,
        "0::/kubepods/pod2/ctr\n",
        "40 23 0:40 /kubepods/pod2/ctr ROOT/cg rw - cgroup2 cgroup2 rw\n",
        {"cg": "usage_usec 900\nnr_throttled 4\nthrottled_usec 250\n"},
    )
    assert cgroup_throttled(proc) == 250_000


def test_the_producer_says_nothing_without_a_cpu_cgroup(tmp_path: Path) -> None:
    # cgroup v2 without the cpu controller: cpu.stat has no throttled time
    proc = _cgroup_tree(
        tmp_path, "0::/job\n", "40 23 0:40 / ROOT/cg rw - cgroup2 cgroup2 rw\n",
        {"cg": "usage_usec 900\n", "cg/job": "usage_usec 400\n"},
    )  # fmt: skip
    assert cgroup_throttled(proc) is None
    assert cgroup_throttled(str(tmp_path / "no-proc")) is None


def test_the_producer_reads_this_process() -> None:
    got = process_cpu()
    if got is None:
        pytest.skip("this kernel keeps no per-thread scheduler counters")
    assert got[0] > 0


def test_a_cpu_quota_shows_as_waiting_for_a_cpu() -> None:
    """A busy process held to a tenth of a CPU by a real cgroup quota waits for a CPU
    most of the time; the same process free does not."""
    cg = Path("/sys/fs/cgroup/cpu")
    if os.geteuid() != 0 or not (cg / "cgroup.procs").exists() or process_cpu() is None:
        pytest.skip("needs root, the cgroup v1 cpu controller and scheduler counters")
    group = cg / f"mttest-{uuid.uuid4().hex[:8]}"
    script = textwrap.dedent(
        """
        import os, sys, time
        from producers.host_cpu import process_cpu
        if len(sys.argv) > 1:
            open(sys.argv[1] + "/cgroup.procs", "w").write(str(os.getpid()))
        from producers.host_cpu import cgroup_throttled
        a, t, ta = process_cpu(), time.monotonic(), cgroup_throttled()
        while time.monotonic() - t < 1.0:
            pass
        b, tb = process_cpu(), cgroup_throttled()
        span = time.monotonic() - t
        print((b[1] - a[1]) / 1e9 / span, (tb - ta) / 1e9 / span)
        """
    )
    root = str(Path(__file__).parents[1])

    def shares(*args: str) -> tuple[float, float]:
        out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True,
                             text=True, check=True, cwd=root)  # fmt: skip
        wait, held = out.stdout.split()
        return float(wait), float(held)

    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("10000")
        waited, held = shares(str(group))
        throttled = NetLab.throttled_ns(group.name)  # the kernel's own account of it
    finally:
        group.rmdir()
    assert waited > 0.6
    assert throttled is not None and throttled > 0.6e9
    # the heartbeats' counter, read by the process itself from its cgroup
    assert held > 0.6
    free_wait, free_held = shares()
    assert free_wait < waited - 0.4 and free_held < 0.1


def test_a_snapshot_from_before_the_rings_reads_the_same() -> None:
    """A worker's snapshot kept each rank's samples newest last, without the throttled
    counter: restored, it gives the same shares and takes new heartbeats after them."""
    keep = 4
    old = CpuWaits.__new__(CpuWaits)
    ts = np.array([[0, 1, 2, 3], [0, 0, 2, 3]]) * S
    waits = np.array([[0, 100, 200, 300], [0, 0, 500, 900]]) * 10**6
    old.__setstate__({"keep": keep, "ts": ts, "waits": waits, "count": np.array([4, 2])})
    assert old.rates(0, 3 * S).tolist() == pytest.approx([0.1, 0.4])
    old.update(0, 4 * S, 700 * 10**6)
    old.update(1, 3 * S, 5 * 10**9)  # not newer than its newest kept: ignored
    assert old.rates(1 * S, 4 * S).tolist() == pytest.approx([0.2, 0.4])
    assert old.rates(0, 4 * S, throttled=True).tolist() == [0.0, 0.0]


def test_a_quota_that_held_a_rank_back_for_less_than_a_heartbeat_is_read_over_its_beats() -> None:
    """Heartbeats every 0.25 s; rank 5's quota held it back 50 ms between the beats at 5
    and 5.25 s, during a burst from 5.05 to 5.11 s. No interval between two heartbeats
    lies within the burst: read over the beats that cover it, rank 5 was throttled a
    fifth of that time, and nobody else at all."""
    cpu = CpuWaits()
    for r in range(8):
        for i in range(41):
            held = 0.05 if r == 5 and i >= 21 else 0.0
            cpu.update(r, int(i * 0.25 * S) + r * 1000, int(0.3 * i * 0.25 * S), int(held * S))
    start, end = int(5.05 * S), int(5.11 * S)
    assert starved(cpu, start, end, NODES) == ()
    (got,) = starved(cpu, start, end, NODES, burst=True)
    assert got.ranks == (5,) and got.throttled == pytest.approx(0.2, rel=0.01)
    assert not cpu.covered(int(10.5 * S)) and cpu.covered(end)
