"""The fault lab's plumbing: "nodes" as Linux network namespaces, and faults the
operating system injects from outside a job.

:class:`NetLab` makes one namespace per node, each with a veth link into a bridge in a
namespace of its own (the switch), so nothing in the host's own network is touched;
a node's ranks run inside its namespace (``ip netns exec``) and talk Gloo over its
link. Faults:

* a slow link: a ``tbf`` rate limit on both ends of a node's veth (``tc``); a failed
  one: both ends set down;
* a slow rank or node: a cgroup v1 ``cpu`` quota on its processes;
* a hung rank: ``SIGSTOP``, or the cgroup v1 ``freezer``; a killed rank: ``SIGKILL``.

Everything made is written down (``lab-state.json``) before it is made, so
:func:`cleanup` removes it after a crash (``megatrace lab --cleanup``); :meth:`NetLab.down`
removes it on the way out, also after a failure. Needs root, iproute2 (``ip``, ``tc``)
and the cgroup v1 ``cpu`` and ``freezer`` controllers: :func:`missing` says what is
not there.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from producers.host_cpu import throttled_in

CGROUP_ROOT = Path("/sys/fs/cgroup")
_PERIOD_US = 100_000


class LabError(RuntimeError):
    """The lab cannot be set up here, or an OS command failed (with its output)."""


def missing() -> str | None:
    """Why the lab cannot run on this machine (None: it can)."""
    if os.geteuid() != 0:
        return "the fault lab needs root (network namespaces, tc, cgroups)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the fault lab needs iproute2's {tool} (apt-get install iproute2)"
    for controller in ("cpu", "freezer"):
        if not (CGROUP_ROOT / controller / "cgroup.procs").exists():
            return f"the fault lab needs the cgroup v1 {controller} controller"
    return None


def _run(*cmd: str, check: bool = True) -> str:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise LabError(f"{' '.join(cmd)}: {res.stderr.strip() or res.stdout.strip()}")
    return res.stdout


@dataclass(frozen=True)
class Node:
    """One lab node: its namespace, its address and its link's two ends."""

    index: int
    name: str  # what records call it
    ns: str
    ip: str
    dev: str  # the link's end inside the node
    switch_dev: str  # its other end, on the bridge

    def exec(self, *argv: str) -> list[str]:
        """``argv`` run inside the node, seeing its CPU cgroups as a container does.

        ``ip netns exec`` mounts a fresh ``/sys`` without the host's cgroup trees, so its
        ranks could not read their cgroup's throttled time (the heartbeats'
        ``cpu_throttled_ns``) as a pod's ranks do; the CPU hierarchy is mounted back at
        ``/sys/fs/cgroup/cpu`` (cgroup v1) or ``/sys/fs/cgroup`` (v2) in the node's own
        mount namespace, which goes with its processes."""
        mount = (
            "mount -t tmpfs cgroup /sys/fs/cgroup && mkdir /sys/fs/cgroup/cpu && "
            "mount -t cgroup -o cpu cgroup /sys/fs/cgroup/cpu "
            "|| mount -t cgroup2 cgroup2 /sys/fs/cgroup"
        )
        script = f'({mount}) 2>/dev/null; exec "$@"'
        return ["ip", "netns", "exec", self.ns, "sh", "-c", script, "sh", *argv]


@dataclass
class _State:
    namespaces: list[str] = field(default_factory=list)
    cgroups: list[str] = field(default_factory=list)  # "controller/name"


class NetLab:
    """The lab's nodes and faults (see the module docstring). A context manager: its
    exit removes every namespace, link, qdisc and cgroup it made."""

    def __init__(
        self, state_dir: Path, nodes: int, prefix: str = "mtlab", subnet: str = "10.77.0"
    ) -> None:
        if not 1 <= nodes <= 8:
            raise ValueError(f"the lab runs 1 to 8 nodes, not {nodes}")
        if len(prefix) > 8 or not prefix.isalnum():
            raise ValueError(f"prefix {prefix!r}: at most 8 letters or digits (device names)")
        self.state_dir = Path(state_dir)
        self.prefix = prefix
        self.switch = f"{prefix}-sw"
        self.nodes = [
            Node(
                i,
                f"lab-n{i}",
                f"{prefix}-n{i}",
                f"{subnet}.{i + 1}",
                f"{prefix}{i}a",
                f"{prefix}{i}b",
            )
            for i in range(nodes)
        ]
        self._state = _State()

    # ------------------------------------------------------------------ state
    @property
    def state_file(self) -> Path:
        return self.state_dir / "lab-state.json"

    def _save(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.state_file.write_text(json.dumps(self._state.__dict__))

    def _note_ns(self, ns: str) -> None:
        self._state.namespaces.append(ns)
        self._save()

    # ------------------------------------------------------------------ up / down
    def up(self) -> list[Node]:
        """Make the switch, the nodes and their links (after removing any left over)."""
        why = missing()
        if why:
            raise LabError(why)
        cleanup(self.state_dir, self.prefix)
        self._note_ns(self.switch)
        _run("ip", "netns", "add", self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        _run("ip", "-n", self.switch, "link", "set", "lo", "up")
        for n in self.nodes:
            self._note_ns(n.ns)
            _run("ip", "netns", "add", n.ns)
            _run("ip", "link", "add", n.dev, "type", "veth", "peer", "name", n.switch_dev)
            _run("ip", "link", "set", n.dev, "netns", n.ns)
            _run("ip", "link", "set", n.switch_dev, "netns", self.switch)
            _run("ip", "-n", self.switch, "link", "set", n.switch_dev, "master", "br0")
            _run("ip", "-n", self.switch, "link", "set", n.switch_dev, "up")
            _run("ip", "-n", n.ns, "addr", "add", f"{n.ip}/24", "dev", n.dev)
            _run("ip", "-n", n.ns, "link", "set", n.dev, "up")
            _run("ip", "-n", n.ns, "link", "set", "lo", "up")
        return self.nodes

    def down(self) -> None:
        """Remove everything this lab made (idempotent)."""
        cleanup(self.state_dir, self.prefix)
        self._state = _State()

    def __enter__(self) -> NetLab:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    # ------------------------------------------------------------------ faults
    def limit_link(self, node: Node, rate_mbit: float) -> None:
        """A slow link: both directions of ``node``'s link limited to ``rate_mbit``."""
        for ns, dev in ((node.ns, node.dev), (self.switch, node.switch_dev)):
            _run(
                "ip",
                "netns",
                "exec",
                ns,
                "tc",
                "qdisc",
                "replace",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                f"{rate_mbit}mbit",
                "burst",
                "64kbit",
                "latency",
                "100ms",
            )

    def clear_link(self, node: Node) -> None:
        for ns, dev in ((node.ns, node.dev), (self.switch, node.switch_dev)):
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)

    def cut_link(self, node: Node, cut: bool = True) -> None:
        """A link that failed: both ends of ``node``'s link down (a NIC or cable lost;
        the node's ranks reach nothing beyond it, and TCP retransmits into it); ``cut``
        False brings it back."""
        state = "down" if cut else "up"
        for ns, dev in ((node.ns, node.dev), (self.switch, node.switch_dev)):
            _run("ip", "-n", ns, "link", "set", dev, state, check=cut)

    def cgroup(
        self, name: str, pids: list[int], controllers: tuple[str, ...] = ("cpu", "freezer")
    ) -> str:
        """A cgroup of each of ``controllers`` holding ``pids``; returns its name.

        A process in a cpu cgroup of its own is scheduled as one entity beside its
        session's others together (the kernel's autogroups), not as one of them: what
        only freezes a rank must not put it in one, and a rank whose quota ended goes
        back (:meth:`leave`)."""
        full = f"{self.prefix}-{name}"
        for controller in controllers:
            path = CGROUP_ROOT / controller / full
            self._state.cgroups.append(f"{controller}/{full}")
            self._save()
            path.mkdir(exist_ok=True)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):  # it ended
                    (path / "cgroup.procs").write_text(str(pid))
        return full

    def leave(self, group: str, controller: str = "cpu") -> None:
        """``group``'s processes back in ``controller``'s root group, where they were."""
        _empty(CGROUP_ROOT / controller / group)

    def quota(self, group: str, cpus: float | None, period_us: int = _PERIOD_US) -> None:
        """Hold ``group`` to ``cpus`` CPUs (a fraction: 0.1 is a tenth of one) in every
        period of ``period_us`` (the kernel's least quota is 1 ms); None lifts it."""
        value = "-1" if cpus is None else str(max(1000, int(cpus * period_us)))
        (CGROUP_ROOT / "cpu" / group / "cpu.cfs_period_us").write_text(str(period_us))
        (CGROUP_ROOT / "cpu" / group / "cpu.cfs_quota_us").write_text(value)

    @staticmethod
    def throttled_ns(group: str) -> int | None:
        """How long ``group`` was held back by its CPU quota so far (the kernel's own
        account, cpu.stat's throttled_time); None where it is not kept."""
        try:
            return throttled_in((CGROUP_ROOT / "cpu" / group / "cpu.stat").read_text())
        except OSError:
            return None

    def freeze(self, group: str, frozen: bool = True) -> None:
        (CGROUP_ROOT / "freezer" / group / "freezer.state").write_text(
            "FROZEN" if frozen else "THAWED"
        )

    @staticmethod
    def signal(pid: int, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _empty(path: Path) -> None:
    """The processes of cgroup ``path`` moved back to the group above it (the root)."""
    for task in (path / "cgroup.procs").read_text().split():
        with contextlib.suppress(ProcessLookupError, OSError):  # it ended
            (path.parent / "cgroup.procs").write_text(task)


def cleanup(state_dir: Path, prefix: str = "mtlab") -> list[str]:
    """Remove what a lab (even one that crashed) made: the cgroups and namespaces its state
    file lists, and any namespace named with the prefix. Returns what was removed."""
    removed: list[str] = []
    state = Path(state_dir) / "lab-state.json"
    cgroups: list[str] = []
    namespaces: list[str] = []
    if state.exists():
        try:
            saved = json.loads(state.read_text())
            cgroups, namespaces = saved.get("cgroups", []), saved.get("namespaces", [])
        except ValueError:
            pass
    for entry in dict.fromkeys(cgroups):
        path = CGROUP_ROOT / entry
        if not path.exists():
            continue
        if entry.startswith("freezer/"):
            (path / "freezer.state").write_text("THAWED")
        _empty(path)
        for _ in range(20):
            try:
                path.rmdir()
                removed.append(entry)
                break
            except OSError:
                time.sleep(0.05)
    listed = _run("ip", "netns", "list", check=False).split("\n")
    present = {line.split()[0] for line in listed if line.strip()}
    for ns in [*namespaces, *sorted(p for p in present if p.startswith(f"{prefix}-"))]:
        if ns in present:
            _run("ip", "netns", "pids", ns, check=False)
            for pid in _run("ip", "netns", "pids", ns, check=False).split():
                NetLab.signal(int(pid), signal.SIGKILL)
            _run("ip", "netns", "del", ns, check=False)
            present.discard(ns)
            removed.append(f"netns {ns}")
    state.unlink(missing_ok=True)
    return removed


__all__ = ["CGROUP_ROOT", "LabError", "NetLab", "Node", "cleanup", "missing"]
