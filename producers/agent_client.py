"""What local producers use to reach the node agent (:class:`AgentClient`): JSON
lines in datagrams on its Unix socket, never blocking and never raising (see
:mod:`producers.agent`)."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import deque
from collections.abc import Iterable

import msgspec

from schemas.codec import encode

#: the largest datagram a client sends (the agent reads at most this much at once)
MAX_DATAGRAM = 1 << 16


class AgentClient:
    """What local producers use to reach the agent: never blocks, never raises.

    Records go out as newline-separated JSON in datagrams of at most 64 KiB. A Unix
    datagram socket queues only a few datagrams (``net.unix.max_dgram_qlen``, 10 by
    default), so a burst from the ranks of a node, or an agent busy for a moment,
    fills it: datagrams the agent cannot take now wait in a backlog of at most
    ``backlog_bytes`` (also while the agent restarts) and go first at the next send.
    Beyond that bound the oldest are dropped and counted (:attr:`dropped`): training
    must never wait for us. :attr:`pending` is what waits now; :meth:`close` tries
    to deliver it for a moment.

    >>> import tempfile
    >>> client = AgentClient(tempfile.mkdtemp() + "/agent.sock")  # nobody listens yet
    >>> client.send_lines([b'{"type":"hb"}'] * 3)
    >>> client.sent, client.pending, client.dropped
    (0, 3, 0)
    """

    def __init__(self, path: str | os.PathLike[str], backlog_bytes: int = 16 << 20) -> None:
        if backlog_bytes < MAX_DATAGRAM:
            raise ValueError(f"backlog_bytes must be at least one datagram ({MAX_DATAGRAM})")
        self.path = str(path)
        self.backlog_bytes = backlog_bytes
        self.sent = 0
        self.dropped = 0
        self._backlog: deque[tuple[bytes, int]] = deque()  # (datagram, its records)
        self._backlog_size = 0
        self._lock = threading.Lock()  # the collector's thread and its final flush
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)

    @property
    def pending(self) -> int:
        """Records waiting in the backlog."""
        return sum(n for _, n in self._backlog)

    def send_lines(self, lines: Iterable[bytes]) -> None:
        buf: list[bytes] = []
        size = 0
        with self._lock:
            for line in lines:
                if size + len(line) + 1 > MAX_DATAGRAM and buf:
                    self._queue(buf)
                    buf, size = [], 0
                buf.append(line)
                size += len(line) + 1
            if buf:
                self._queue(buf)
            self._drain()

    def send(self, records: Iterable[msgspec.Struct]) -> None:
        self.send_lines(encode(r) for r in records)

    def _queue(self, lines: list[bytes]) -> None:
        data = b"\n".join(lines)
        self._backlog.append((data, len(lines)))
        self._backlog_size += len(data)
        while self._backlog_size > self.backlog_bytes:  # bounded: the oldest go
            old, n = self._backlog.popleft()
            self._backlog_size -= len(old)
            self.dropped += n

    def _drain(self) -> bool:
        """Send the backlog in order until the agent's queue is full; True if emptied."""
        backlog = self._backlog
        while backlog:
            data, n = backlog[0]
            try:
                self._sock.sendto(data, self.path)
            except (BlockingIOError, FileNotFoundError, ConnectionRefusedError):
                return False  # full, or no agent (yet, or restarting): try again next time
            except OSError:  # this datagram can never go (e.g. too large): drop, count
                self.dropped += n
            else:
                self.sent += n
            backlog.popleft()
            self._backlog_size -= len(data)
        return True

    def flush(self, timeout_s: float = 1.0) -> bool:
        """Try to deliver the backlog for up to ``timeout_s``; True if it is empty."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if self._drain():
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)

    def close(self, timeout_s: float = 1.0) -> None:
        """Deliver what waits (for up to ``timeout_s``), then close; what is left is
        counted as dropped."""
        self.flush(timeout_s)
        with self._lock:
            self.dropped += self.pending
            self._backlog.clear()
            self._backlog_size = 0
        self._sock.close()


__all__ = ["MAX_DATAGRAM", "AgentClient"]
