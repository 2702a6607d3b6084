"""Alert webhooks: payloads (generic JSON, Slack, Feishu/Lark) and delivery.

Delivery never stalls the flow: :meth:`WebhookDelivery.submit` puts the alert
on one bounded queue per endpoint and returns; a thread per endpoint posts,
retrying connection errors, timeouts, 429 and 5xx answers with exponential
backoff (honouring ``Retry-After``), and gives up after ``max_retries``. When
an endpoint's queue is full the oldest alert is dropped and counted. Other 4xx
answers are not retried (the request itself is wrong). Endpoint URLs and
signing secrets are never logged: log lines name the endpoint.

Signing (when the endpoint has a ``secret``): generic and Slack requests carry
``X-Megatrace-Timestamp`` and ``X-Megatrace-Signature: sha256=<hex>``, the
HMAC-SHA256 of ``"<timestamp>.<body>"``; Feishu requests carry its own
``timestamp`` and ``sign`` fields (HMAC-SHA256 keyed by
``"<timestamp>\\n<secret>"`` over an empty message, base64).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from bytewax.outputs import DynamicSink, StatelessSinkPartition

from schemas.config import ALERT_LEVELS, AlertSettings, WebhookSettings
from schemas.results import Alert

log = logging.getLogger(__name__)

_ICON = {"open": "🔴", "update": "🟠", "resolved": "✅"}


def alert_text(a: Alert) -> str:
    """One human line (plus a location line) for chat payloads."""
    v = a.verdict
    head = f"{_ICON[a.event.value]} [{a.level.value.upper()}] {a.event.value}: {v.summary}"
    where = [f"job {v.job}"]
    if v.step is not None:
        where.append(f"step {v.step}")
    if v.severity:
        where.append(f"{v.severity:.0%} throughput lost")
    where.append(f"incident {v.verdict_id}")
    tail = f"\n(+{a.suppressed} more incidents not announced)" if a.suppressed else ""
    return f"{head}\n{' · '.join(where)}{tail}"


def payload(a: Alert, fmt: str) -> dict[str, Any]:
    """The JSON body for an endpoint format (``generic``, ``slack``, ``feishu``)."""
    if fmt == "generic":
        return msgspec.to_builtins(a)
    text = alert_text(a)
    if fmt == "slack":
        return {
            "text": text,
            "blocks": [{"type": "section", "text": {"type": "mrkdwn", "text": text}}],
        }
    if fmt == "feishu":
        return {"msg_type": "text", "content": {"text": text}}
    raise ValueError(f"unknown webhook format {fmt!r}")


def sign_generic(secret: str, ts: int, body: bytes) -> str:
    """``sha256=<hex>`` of HMAC-SHA256(secret, "<ts>.<body>").

    >>> sign_generic("s", 1, b"{}")[:15]
    'sha256=b253639b'
    """
    mac = hmac.new(secret.encode(), f"{ts}.".encode() + body, hashlib.sha256)
    return f"sha256={mac.hexdigest()}"


def sign_feishu(secret: str, ts: int) -> str:
    """Feishu/Lark custom-bot signature for a timestamp (seconds)."""
    mac = hmac.new(f"{ts}\n{secret}".encode(), b"", hashlib.sha256)
    return base64.b64encode(mac.digest()).decode()


def request_for(a: Alert, hook: WebhookSettings, now_s: int) -> tuple[bytes, dict[str, str]]:
    """Body and headers for one alert to one endpoint."""
    body_obj = payload(a, hook.format)
    headers = {"Content-Type": "application/json", "User-Agent": "megatrace"}
    secret = hook.secret.get()
    if secret and hook.format == "feishu":
        body_obj = {"timestamp": str(now_s), "sign": sign_feishu(secret, now_s), **body_obj}
    body = msgspec.json.encode(body_obj)
    if secret and hook.format != "feishu":
        headers["X-Megatrace-Timestamp"] = str(now_s)
        headers["X-Megatrace-Signature"] = sign_generic(secret, now_s, body)
    headers["Idempotency-Key"] = a.alert_id
    return body, headers


def wanted(a: Alert, hook: WebhookSettings) -> bool:
    """Severity and kind routing of one endpoint."""
    if ALERT_LEVELS.index(a.level.value) < ALERT_LEVELS.index(hook.min_level):
        return False
    return not hook.kinds or a.verdict.kind.value in hook.kinds


@dataclass
class EndpointStats:
    """What one endpoint's delivery did (``megatrace`` reports these)."""

    queued: int = 0
    delivered: int = 0
    retried: int = 0
    failed: int = 0
    dropped: int = 0
    last_error: str = ""
    latencies_s: list[float] = field(default_factory=list)


class _Endpoint:
    def __init__(
        self, hook: WebhookSettings, queue_size: int, sleep: Callable[[float], None]
    ) -> None:
        self.hook = hook
        self.stats = EndpointStats()
        self._q: queue.Queue[Alert | None] = queue.Queue(maxsize=queue_size)
        self._sleep = sleep
        self._stop = threading.Event()  # closing: no more retries, no waits between them
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=f"webhook-{hook.name}", daemon=True)
        self._thread.start()

    def submit(self, a: Alert) -> None:
        with self._lock:
            while True:
                try:
                    self._q.put_nowait(a)
                    self.stats.queued += 1
                    return
                except queue.Full:
                    try:
                        dropped = self._q.get_nowait()
                    except queue.Empty:
                        continue
                    self._q.task_done()
                    if dropped is not None:
                        self.stats.dropped += 1
                        if self.stats.dropped % 100 == 1:  # loudly, but not a log storm
                            log.warning(
                                "webhook %s: queue full (%d), dropped the oldest alert "
                                "(%d dropped so far)",
                                self.hook.name,
                                self._q.maxsize,
                                self.stats.dropped,
                            )

    def close(self, timeout_s: float) -> None:
        """Stop: the alert in flight gets its current attempt (at most the endpoint's
        ``timeout_s``) and no more; alerts still queued are never attempted. Both are
        said in the log, with their ids. Returns within ``timeout_s``."""
        self._stop.set()
        never: list[str] = []
        with self._lock:
            while True:
                try:
                    a = self._q.get_nowait()
                except queue.Empty:
                    break
                self._q.task_done()
                if a is not None:
                    never.append(a.alert_id)
            self._q.put_nowait(None)  # room: the queue was just emptied
        if never:
            self.stats.dropped += len(never)
            log.warning(
                "webhook %s: closing with %d alert(s) never attempted: %s",
                self.hook.name,
                len(never),
                ", ".join(never[:10]) + (" ..." if len(never) > 10 else ""),
            )
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning(
                "webhook %s: an alert was still being delivered at shutdown (%s); abandoned",
                self.hook.name,
                self.stats.last_error or "no answer yet",
            )

    def idle(self) -> bool:
        return self._q.unfinished_tasks == 0

    def _loop(self) -> None:
        while True:
            a = self._q.get()
            try:
                if a is None:
                    return
                self._deliver(a)
            finally:
                self._q.task_done()

    def _deliver(self, a: Alert) -> None:
        hook, t0 = self.hook, time.monotonic()
        for attempt in range(hook.max_retries + 1):
            body, headers = request_for(a, hook, int(time.time()))
            req = urllib.request.Request(hook.url.get(), data=body, headers=headers)
            retry_after: float | None = None
            try:
                with urllib.request.urlopen(req, timeout=hook.timeout_s) as resp:
                    resp.read()
                self.stats.delivered += 1
                self.stats.latencies_s.append(time.monotonic() - t0)
                return
            except urllib.error.HTTPError as e:
                self.stats.last_error = f"HTTP {e.code}"
                if e.code != 429 and e.code < 500:
                    break
                if e.headers and e.headers.get("Retry-After", "").isdigit():
                    retry_after = float(e.headers["Retry-After"])
            except (urllib.error.URLError, TimeoutError, OSError) as e:
                reason = getattr(e, "reason", e)
                self.stats.last_error = type(reason).__name__
            if attempt < hook.max_retries and not self._stop.is_set():
                self.stats.retried += 1
                delay = min(hook.backoff_s * 2**attempt, hook.max_backoff_s)
                self._pause(retry_after if retry_after is not None else delay)
            if self._stop.is_set():
                break
        self.stats.failed += 1
        why = "shutting down" if self._stop.is_set() else f"{attempt + 1} attempts"
        log.warning(
            "webhook %s: gave up on alert %s after %s (%s)",
            hook.name,
            a.alert_id,
            why,
            self.stats.last_error,
        )

    def _pause(self, seconds: float) -> None:
        """Wait between retries; cut short when closing."""
        if self._sleep is time.sleep:
            self._stop.wait(seconds)
        else:  # a test's clock
            self._sleep(seconds)


class WebhookDelivery:
    """Delivers alerts to every configured endpoint that wants them, in the background."""

    def __init__(
        self, settings: AlertSettings, sleep: Callable[[float], None] = time.sleep
    ) -> None:
        self._endpoints = [_Endpoint(h, settings.queue_size, sleep) for h in settings.webhooks]

    def submit(self, a: Alert) -> None:
        for ep in self._endpoints:
            if wanted(a, ep.hook):
                ep.submit(a)

    def stats(self) -> dict[str, EndpointStats]:
        return {ep.hook.name: ep.stats for ep in self._endpoints}

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every queue is empty and nothing is in flight (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(ep.idle() for ep in self._endpoints):
                return True
            time.sleep(0.01)
        return False

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop every endpoint (see ``_Endpoint.close``), in ``timeout_s`` in all."""
        deadline = time.monotonic() + timeout_s
        for ep in self._endpoints:
            ep._stop.set()  # all at once: none waits behind another's retries
        for ep in self._endpoints:
            ep.close(max(0.0, deadline - time.monotonic()))


class _WebhookPartition(StatelessSinkPartition[Alert]):
    def __init__(self, settings: AlertSettings) -> None:
        self.delivery = WebhookDelivery(settings)

    def write_batch(self, items: list[Alert]) -> None:
        for a in items:
            self.delivery.submit(a)

    def close(self) -> None:
        # the end of a bounded run: a few seconds for what is queued, then stop, saying
        # what was not delivered (an endpoint that hangs must not hold the run up)
        self.delivery.wait_idle(5.0)
        self.delivery.close(5.0)


class WebhookSink(DynamicSink[Alert]):
    """Bytewax sink handing alerts to :class:`WebhookDelivery` (never blocks the flow)."""

    def __init__(self, settings: AlertSettings) -> None:
        self.settings = settings

    def build(self, step_id: str, worker_index: int, worker_count: int) -> _WebhookPartition:
        return _WebhookPartition(self.settings)


__all__ = ["WebhookDelivery", "WebhookSink", "alert_text", "payload", "request_for", "wanted"]
