"""The node agent: one per GPU node, from local producers to Kafka without loss.

Local producers (the PyTorch collector, the NCCL profiler plugin, readers of
log files) hand the agent JSON lines, either as datagrams on a Unix socket
(:class:`~producers.agent_client.AgentClient`, which never blocks them) or in
files the agent tails. The agent stamps the job and node on records that lack
them, validates every line with the schema codec (a refused line becomes a dead
letter, counted and published to the dead-letter topic), and appends it to its
:class:`Spool` on disk. A publisher thread (:mod:`producers.agent_publish`)
sends the spool, in order, with an idempotent, compressing Kafka producer, and
moves the spool's cursor only over records the broker acknowledged. When the
broker is unreachable the spool grows (bounded; when full, new records are
dropped, counted and logged) and drains in order when the broker returns.
Health (records in and out, refused, dropped, the spool's size and lag, whether
the broker is reachable) is logged and written to a JSON file.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from producers.agent_client import MAX_DATAGRAM
from producers.agent_publish import SpoolPublisher, pack
from producers.nccl_inspector import InspectorReader
from producers.spool import Spool, SpoolError
from producers.tail import new_lines
from schemas.codec import SchemaError, dead_letter, decode_input, encode
from schemas.config import AgentSettings
from schemas.enums import DeadLetterReason
from schemas.topics import Topics, message_key

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- agent


@dataclass
class AgentHealth:
    """What the agent is doing. ``dropped``: refused because the spool was full;
    ``lost``: accepted, then unreadable from a damaged spool; ``threads``: each of the
    agent's threads and whether it runs (a dead one makes the agent unhealthy)."""

    accepted: int = 0
    refused: int = 0
    dropped: int = 0
    lost: int = 0
    delivered: int = 0
    delivery_errors: int = 0
    inflight: int = 0
    spool_bytes: int = 0
    pending_bytes: int = 0
    broker_up: bool = False
    last_error: str = ""
    threads: dict[str, bool] = field(default_factory=dict)
    ts: float = 0.0

    @property
    def healthy(self) -> bool:
        return all(self.threads.values())


class NodeAgent:
    """Accepts lines, spools them, and publishes the spool (see the module docstring)."""

    def __init__(
        self,
        settings: AgentSettings,
        producer_config: dict[str, str],
        topics: Topics,
        state_dir: Path,
    ) -> None:
        settings = settings.paths(state_dir)
        self.settings = settings
        self.topics = topics
        self.node = settings.node or socket.gethostname()
        self.state_dir = Path(state_dir)
        self.health = AgentHealth()
        self.spool = Spool(
            settings.spool_dir, max_bytes=settings.spool_max_mb << 20, on_loss=self._lost
        )
        self._producer_config = {
            "compression.type": "lz4",
            "linger.ms": "20",
            "message.timeout.ms": "30000",
            **producer_config,
        }
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._offsets_file = self.state_dir / "agent-tail-offsets.json"
        self._offsets: dict[str, int] = self._load_offsets()
        self._inspector = InspectorReader(settings.job or "nccl-inspector")
        self._publisher = SpoolPublisher(
            self.spool,
            self._lock,
            self.health,
            self._producer_config,
            max_inflight=settings.max_inflight,
            stall_s=settings.stall_s,
            stop=self._stop,
        )

    # ------------------------------------------------------------------ input
    def _stamp(self, raw: bytes, err: SchemaError) -> bytes | None:
        """Fill in job/node on a record that lacks them (None: cannot help)."""
        if err.reason != DeadLetterReason.MISSING_FIELD or err.field not in ("job", "node"):
            return None
        try:
            obj = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            return None
        if not isinstance(obj, dict):
            return None
        if self.settings.job:
            obj.setdefault("job", self.settings.job)
        obj.setdefault("node", self.node)
        return msgspec.json.encode(obj)

    def _lost(self, what: str, entries: int) -> None:
        """Accepted records the spool could not read back (damaged on disk)."""
        self.health.lost += entries
        self.health.last_error = f"spool damaged: {what}"
        log.error(
            "agent spool: %s; %d accepted record(s) lost (%d so far)",
            what,
            entries,
            self.health.lost,
        )

    def _frame(self, line: bytes, source: str) -> tuple[bytes, bool]:
        """One input line as its spool frame, and whether it was refused (a dead letter)."""
        raw = line
        err: SchemaError | None = None
        for _ in range(3):  # stamping may supply job, then node
            try:
                rec = decode_input(raw)
                return pack(self.topics.for_record(rec), message_key(rec), raw), False
            except SchemaError as e:
                err = e
                stamped = self._stamp(raw, e)
                if stamped is None or stamped == raw:
                    break
                raw = stamped
        assert err is not None
        dead = dead_letter(raw, err, now_ns=time.time_ns(), step_id=f"agent:{source}")
        return pack(self.topics.deadletter, None, encode(dead)), True

    def accept(self, lines: Iterable[bytes], source: str = "socket") -> int:
        """Validate, stamp and spool lines; return how many were spooled. A line that
        cannot be read becomes a dead letter; none stops the agent."""
        frames: list[bytes] = []
        refused = 0
        for line in lines:
            raw = line.strip()
            if not raw:
                continue
            try:
                entry, bad = self._frame(raw, source)
            except Exception as exc:  # a defect, not the line's: still kept, never fatal
                log.exception("agent: a line from %s could not be handled", source)
                err = SchemaError(
                    DeadLetterReason.MALFORMED, f"could not be handled ({type(exc).__name__})"
                )
                dead = dead_letter(raw, err, now_ns=time.time_ns(), step_id=f"agent:{source}")
                entry, bad = pack(self.topics.deadletter, None, encode(dead)), True
            frames.append(entry)
            refused += bad
        with self._lock:
            taken = self.spool.append(frames)
            self.health.accepted += taken
            self.health.refused += refused
            lost = len(frames) - taken
            if lost:
                self.health.dropped += lost
                log.error(
                    "agent spool full (%d MiB): dropped %d records (%d so far)",
                    self.settings.spool_max_mb,
                    lost,
                    self.health.dropped,
                )
        return taken

    def _bind(self) -> socket.socket:
        path = Path(self.settings.socket)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.unlink(missing_ok=True)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
            sock.bind(str(path))
        except OSError as e:
            raise SpoolError(f"the agent cannot listen on {path}: {e}") from None
        sock.settimeout(0.2)
        return sock

    def _serve_socket(self) -> None:
        path = Path(self.settings.socket)
        sock = self._sock
        try:
            while not self._stop.is_set():
                try:
                    data = sock.recv(MAX_DATAGRAM)
                except TimeoutError:
                    continue
                try:
                    self.accept(data.split(b"\n"), "socket")
                except Exception:  # e.g. the spool's disk: say so, keep listening
                    log.exception("agent: a datagram could not be spooled")
        finally:
            sock.close()
            path.unlink(missing_ok=True)

    def _load_offsets(self) -> dict[str, int]:
        try:
            return {k: int(v) for k, v in json.loads(self._offsets_file.read_text()).items()}
        except (OSError, ValueError):
            return {}

    def tail_once(self) -> int:
        """Read what was appended to the tailed files since last time (megatrace records,
        and the NCCL Inspector's output, turned into records); return lines taken."""
        taken = 0
        moved = False
        for pattern in self.settings.tail:
            for name in sorted(glob.glob(pattern)):
                data = new_lines(name, self._offsets)
                if data:
                    taken += self.accept(data.split(b"\n"), f"file:{name}")
                    moved = True
        for pattern in self.settings.inspector:
            for name in sorted(glob.glob(pattern)):
                data = new_lines(name, self._offsets)
                if data:
                    self._inspector.feed(name, data.split(b"\n"))
                    moved = True
        if self.settings.inspector:
            records = self._inspector.drain()
            if records:
                taken += self.accept([encode(r) for r in records], "inspector")
        if moved:
            tmp = self._offsets_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(self._offsets))
            os.replace(tmp, self._offsets_file)
        return taken

    def _serve_tail(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self.tail_once()
            except Exception:
                log.exception("agent: tailing failed; trying again")
                self._stop.wait(1.0)

    def _guarded(self, target: Any) -> Any:
        """A thread's body that reports its death in the health, and restarts the
        publisher (the spool keeps what it has not delivered) rather than leaving it dead."""
        name = target.__name__.strip("_")

        def run() -> None:
            self.health.threads[name] = True
            while True:
                try:
                    target()
                    return
                except Exception as exc:
                    self.health.last_error = f"{name}: {type(exc).__name__}: {exc}"
                    log.exception("agent: its %s thread failed", name)
                    if name != "publish" or self._stop.is_set():
                        self.health.threads[name] = False
                        return
                    self._stop.wait(1.0)
                    with self._lock:
                        self.spool.rewind()  # resend what was in flight

        return run

    # ------------------------------------------------------------------ output
    def _publish(self) -> None:
        self._publisher.run()

    # ------------------------------------------------------------------ control
    def snapshot(self) -> AgentHealth:
        with self._lock:
            self.health.spool_bytes = self.spool.size_bytes
            self.health.pending_bytes = self.spool.pending()
        self.health.ts = time.time()
        alive = {t.name.removeprefix("agent-_"): t.is_alive() for t in self._threads}
        for name, up in alive.items():
            if not up and not self._stop.is_set():
                self.health.threads[name] = False
        return AgentHealth(**{**asdict(self.health), "threads": dict(self.health.threads)})

    def write_health(self) -> AgentHealth:
        h = self.snapshot()
        path = Path(self.settings.health_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**asdict(h), "healthy": h.healthy}))
        os.replace(tmp, path)
        return h

    def start(self) -> None:
        """Listen on the socket (at once: a producer may send as soon as this returns) and
        start the agent's threads."""
        self._publisher.drain_deadline = float("inf")
        self._sock = self._bind()
        targets = [self._publish, self._serve_socket]
        if self.settings.tail or self.settings.inspector:
            targets.append(self._serve_tail)
        for target in targets:
            t = threading.Thread(
                target=self._guarded(target), name=f"agent-{target.__name__}", daemon=True
            )
            t.start()
            self._threads.append(t)

    def stop(self, drain_s: float = 10.0) -> None:
        """Stop taking input; try for ``drain_s`` to deliver what is spooled."""
        self._publisher.drain_deadline = time.monotonic() + drain_s
        self._stop.set()
        for t in self._threads:
            t.join(drain_s + 5)
        with contextlib.suppress(Exception):
            self.write_health()
        self.spool.close()


__all__ = ["AgentHealth", "NodeAgent"]
