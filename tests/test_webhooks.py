"""Alert webhooks against a real local HTTP server: dedup, update, resolve,
retries, a failing endpoint, a dead one, and the whole flow delivering them."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import msgspec
import pytest
from bytewax.testing import run_main

from detectors.alerting import AlertGate
from flows.main import build_flow
from flows.webhooks import WebhookDelivery, payload, sign_generic
from producers.sim.scenarios import build
from schemas.config import AlertSettings, Settings, WebhookSettings, load_settings
from schemas.enums import AlertLevel, Cause, VerdictKind, VerdictStatus
from schemas.results import Alert, Verdict
from tests.helpers import flow_config, publisher


@dataclass
class Hook:
    """A local webhook receiver: answers with ``codes`` in turn (then 200)."""

    url: str
    codes: list[int] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)
    received: list[tuple[dict[str, str], bytes]] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)

    def bodies(self) -> list[dict[str, Any]]:
        return [json.loads(b) for _, b in self.received]


@pytest.fixture
def hook() -> Iterator[Hook]:
    state = Hook(url="")
    state.release.set()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            state.release.wait(30)
            code = state.codes.pop(0) if state.codes else 200
            if code == 200:
                state.received.append((dict(self.headers), body))
            self.send_response(code)
            for k, v in state.headers.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{server.server_port}/hook/t0k3n-s3cret"
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield state
    state.release.set()
    server.shutdown()


def verdict(
    vid: str = "v1",
    rev: int = 0,
    sev: float = 0.3,
    t_s: float = 0,
    kind: VerdictKind = VerdictKind.SLOWDOWN,
    status: VerdictStatus = VerdictStatus.OPEN,
) -> Verdict:
    return Verdict(
        job="j",
        verdict_id=vid,
        revision=rev,
        status=status,
        kind=kind,
        cause=Cause.COMPUTE,
        rank=15,
        node="node-3",
        onset_ns=0,
        detected_ns=int(t_s * 1e9),
        severity=sev,
        summary=f"{kind.value}: rank 15",
    )


def alert(v: Verdict | None = None) -> Alert:
    (a,) = AlertGate().update(v or verdict())
    return a


def webhook(url: str, **kw: Any) -> WebhookSettings:
    hooks = [{"name": "test", "url": url, **kw}]
    return load_settings(overrides={"alerts": {"webhooks": hooks}}).alerts.webhooks[0]


def delivery(*hooks: WebhookSettings, queue_size: int = 100, sleeps: list | None = None):
    record = sleeps if sleeps is not None else []
    return WebhookDelivery(
        AlertSettings(webhooks=list(hooks), queue_size=queue_size), sleep=record.append
    )


# --------------------------------------------------------------------------- the gate


def test_one_alert_per_incident_with_meaningful_updates_and_a_resolution() -> None:
    gate = AlertGate(AlertSettings(update_interval_s=60))
    events = []
    for rev, (sev, t) in enumerate([(0.12, 0), (0.14, 10), (0.25, 20), (0.26, 30), (0.27, 200)]):
        events += [
            (a.event.value, a.level.value) for a in gate.update(verdict(rev=rev, sev=sev, t_s=t))
        ]
    events += [
        a.event.value for a in gate.update(verdict(rev=9, t_s=300, status=VerdictStatus.RESOLVED))
    ]
    # open; 0.14 is no news; 0.25 crosses into critical at once; 0.26/0.27 are small moves
    assert events == [("open", "warning"), ("update", "critical"), "resolved"]


def test_severity_moves_are_announced_only_after_the_update_interval() -> None:
    gate = AlertGate(AlertSettings(update_interval_s=60, critical=0.9))
    assert gate.update(verdict(sev=0.3, t_s=0))
    assert gate.update(verdict(rev=1, sev=0.5, t_s=30)) == []
    (a,) = gate.update(verdict(rev=2, sev=0.5, t_s=61))
    assert (a.event, a.alert_id) == (VerdictStatus.UPDATE, "v1:update:2")


def test_a_storm_of_incidents_is_capped_and_counted_but_hangs_always_page() -> None:
    gate = AlertGate(AlertSettings(max_incidents_per_hour=3))
    sent = [a for i in range(50) for a in gate.update(verdict(vid=f"s{i}", t_s=i))]
    assert len(sent) == 3
    (hang,) = gate.update(verdict(vid="h", kind=VerdictKind.HANG, sev=1.0, t_s=60))
    assert (hang.level, hang.suppressed) == (AlertLevel.CRITICAL, 47)
    # suppressed incidents never resolve noisily either
    assert gate.update(verdict(vid="s10", status=VerdictStatus.RESOLVED, t_s=70)) == []
    # an hour later there is room again
    assert gate.update(verdict(vid="late", t_s=4000))


def test_the_gate_rejects_inconsistent_levels() -> None:
    with pytest.raises(ValueError, match="warning <= critical"):
        AlertGate(AlertSettings(warning=0.5, critical=0.1))


# --------------------------------------------------------------------------- payloads


def test_payload_formats() -> None:
    a = alert(verdict(kind=VerdictKind.HANG, sev=1.0))
    generic = payload(a, "generic")
    assert generic["verdict"]["rank"] == 15 and generic["level"] == "critical"
    assert msgspec.convert(generic, Alert) == a  # the generic payload is the schema type
    slack = payload(a, "slack")
    assert "CRITICAL" in slack["text"] and slack["blocks"][0]["text"]["text"] == slack["text"]
    feishu = payload(a, "feishu")
    assert feishu["msg_type"] == "text" and "rank 15" in feishu["content"]["text"]


def test_signed_requests_verify_at_the_receiver(hook: Hook) -> None:
    d = delivery(webhook(hook.url, secret="k3y"), webhook(hook.url, format="feishu", secret="k3y"))
    d.submit(alert())
    assert d.wait_idle(10)
    by_format = {("msg_type" in json.loads(b)): (h, b) for h, b in hook.received}
    headers, body = by_format[False]
    ts = int(headers["X-Megatrace-Timestamp"])
    assert headers["X-Megatrace-Signature"] == sign_generic("k3y", ts, body)
    assert headers["Idempotency-Key"] == "v1:open:0"
    fs = json.loads(by_format[True][1])
    mac = hmac.new(f"{fs['timestamp']}\nk3y".encode(), b"", hashlib.sha256).digest()
    assert fs["sign"] == base64.b64encode(mac).decode()


def test_routing_by_level_and_kind(hook: Hook) -> None:
    d = delivery(
        webhook(hook.url, name="pager", min_level="critical"),
        webhook(hook.url, name="links", kinds=["link_degradation"]),
    )
    d.submit(alert(verdict(vid="a", sev=0.06)))  # warning slowdown: nobody
    d.submit(alert(verdict(vid="b", sev=1.0, kind=VerdictKind.HANG)))  # pager
    d.submit(alert(verdict(vid="c", sev=0.06, kind=VerdictKind.LINK_DEGRADATION)))  # links
    # a step's hiccup, over when told, wakes no pager whatever share of its steps it
    # cost; its return as an intermittent slowdown does
    d.submit(alert(verdict(vid="d", sev=0.6, kind=VerdictKind.TRANSIENT_STRAGGLER)))
    d.submit(alert(verdict(vid="e", sev=0.3, kind=VerdictKind.INTERMITTENT_SLOWDOWN)))
    assert d.wait_idle(10)
    assert sorted(b["verdict"]["verdict_id"] for b in hook.bodies()) == ["b", "c", "e"]
    assert {n: s.delivered for n, s in d.stats().items()} == {"pager": 2, "links": 1}


# --------------------------------------------------------------------------- delivery


def test_a_failing_endpoint_is_retried_with_backoff_until_it_answers(hook: Hook) -> None:
    hook.codes = [500, 503, 429]
    hook.headers = {}
    sleeps: list[float] = []
    d = delivery(webhook(hook.url, backoff_s=0.5), sleeps=sleeps)
    d.submit(alert())
    assert d.wait_idle(10)
    stats = d.stats()["test"]
    assert (stats.delivered, stats.retried, stats.failed) == (1, 3, 0)
    assert sleeps == [0.5, 1.0, 2.0]
    assert len(hook.received) == 1


def test_retry_after_is_honoured(hook: Hook) -> None:
    hook.codes = [429]
    hook.headers = {"Retry-After": "7"}
    sleeps: list[float] = []
    d = delivery(webhook(hook.url), sleeps=sleeps)
    d.submit(alert())
    assert d.wait_idle(10)
    assert sleeps == [7.0] and d.stats()["test"].delivered == 1


def test_a_client_error_is_not_retried(hook: Hook) -> None:
    hook.codes = [400]
    d = delivery(webhook(hook.url))
    d.submit(alert())
    assert d.wait_idle(10)
    s = d.stats()["test"]
    assert (s.delivered, s.retried, s.failed, s.last_error) == (0, 0, 1, "HTTP 400")


def test_a_dead_endpoint_gives_up_and_never_logs_its_secrets(caplog: Any) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/hook/t0k3n-s3cret"
    d = delivery(webhook(url, max_retries=2, secret="hmac-s3cret"))
    with caplog.at_level(logging.WARNING):
        d.submit(alert())
        assert d.wait_idle(10)
    s = d.stats()["test"]
    assert (s.delivered, s.retried, s.failed) == (0, 2, 1)
    assert "gave up" in caplog.text and "test" in caplog.text
    assert "t0k3n" not in caplog.text and "hmac-s3cret" not in caplog.text


def test_a_stuck_endpoint_never_blocks_the_caller_and_drops_the_oldest(hook: Hook) -> None:
    hook.release.clear()  # the server accepts and then sits on every request
    d = delivery(webhook(hook.url, timeout_s=30), queue_size=10)
    for i in range(500):
        d.submit(alert(verdict(vid=f"v{i}")))
    stats = d.stats()["test"]
    assert stats.dropped >= 500 - 10 - 1  # one may be in flight, ten wait
    hook.release.set()
    assert d.wait_idle(20)
    ids = [b["verdict"]["verdict_id"] for b in hook.bodies()]
    assert ids[-1] == "v499" and len(ids) == 500 - stats.dropped


# --------------------------------------------------------------------------- in the flow


@pytest.mark.integration
def test_the_flow_pages_once_per_incident(settings: Settings, hook: Hook) -> None:
    run = build("story", scale="tiny", seed=1, steps=30, kernels=False)
    pub = publisher(settings)
    pub.publish_all(run.records())
    pub.flush()
    alerts = AlertSettings(webhooks=[webhook(hook.url, format="generic")])
    run_main(build_flow(flow_config(msgspec.structs.replace(settings, alerts=alerts))))
    bodies = hook.bodies()
    opened = {b["verdict"]["kind"]: b for b in bodies if b["event"] == "open"}
    assert set(opened) == {"hang", "slowdown", "link_degradation"}
    assert opened["hang"]["level"] == "critical"
    assert opened["hang"]["verdict"]["rank"] == run.labels[2].rank
    ids = [b["alert_id"] for b in bodies]
    assert len(ids) == len(set(ids))  # no repeats
    per_incident = {b["verdict"]["verdict_id"] for b in bodies}
    assert len(per_incident) == 3 and len(bodies) <= 6


def test_a_hanging_endpoint_does_not_hold_up_shutdown_and_what_is_lost_is_said(
    hook: Hook, caplog: Any
) -> None:
    """A bounded run once took 74 s to end behind an endpoint that never answers
    (``queue_size = 1``), and the alerts never attempted left no trace."""
    import time

    hook.release.clear()  # the server accepts and then sits on every request
    d = WebhookDelivery(AlertSettings(webhooks=[webhook(hook.url, timeout_s=2)], queue_size=1))
    with caplog.at_level(logging.WARNING):
        d.submit(alert(verdict(vid="v0")))
        deadline = time.monotonic() + 5
        while not hook_in_flight(d) and time.monotonic() < deadline:
            time.sleep(0.01)
        d.submit(alert(verdict(vid="v1")))  # waits behind it
        t0 = time.monotonic()
        assert not d.wait_idle(1.0)
        d.close(5.0)
        took = time.monotonic() - t0
    hook.release.set()
    assert took < 6, took
    assert "1 alert(s) never attempted: v1:open:0" in caplog.text
    assert "gave up on alert v0:open:0" in caplog.text
    assert "shutting down" in caplog.text and "t0k3n" not in caplog.text


def hook_in_flight(d: WebhookDelivery) -> bool:
    """The endpoint's thread took the alert off its queue: it is being delivered."""
    (ep,) = d._endpoints
    return ep._q.empty() and not ep.idle()
