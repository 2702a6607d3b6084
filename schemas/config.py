"""Settings: the one home of configuration.

Precedence, lowest to highest: built-in defaults, the TOML config file
(``--config``, else ``$MEGATRACE_CONFIG``, else ``./megatrace.toml`` if present),
environment variables ``MEGATRACE_<SECTION>__<KEY>``, then command-line flags.
Only the command-line entry point calls :func:`load_settings`; everything
else receives the resulting :class:`Settings` (or a section of it).

>>> s = load_settings(env={"MEGATRACE_KAFKA__BOOTSTRAP_SERVERS": "k1:9092",
...                        "MEGATRACE_KAFKA__SASL_PASSWORD": "hunter2"},
...                   overrides={"clickhouse": {"retention_days": 7}})
>>> s.kafka.bootstrap_servers, s.clickhouse.retention_days
('k1:9092', 7)
>>> s.kafka.sasl_password
Secret('********')
>>> "hunter2" in repr(s)
False
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from schemas.secrets import Secret, redact_url


class ConfigError(ValueError):
    """A configuration value is missing, unknown or of the wrong type."""


class KafkaSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where the broker is. ``bootstrap_servers`` empty means the local stack's broker."""

    bootstrap_servers: str = ""
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str = ""
    sasl_username: str = ""
    sasl_password: Secret = Secret("")
    ssl_ca_location: str = ""
    topic_prefix: str = "megatrace."
    partitions: int = 4
    replication_factor: int = 1
    client_options: dict[str, str] = msgspec.field(default_factory=dict)
    #: how long a bounded run (``megatrace run --once``, the demo) waits for a broker that
    #: stopped answering before it fails (a tailing flow waits as long as it takes)
    outage_wait_s: float = 300.0


class ClickHouseSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where verdicts and summaries go.

    ``url`` is ``chdb:///DIR`` for the embedded engine, ``http(s)://user:pass@host:port/db``
    for a server; empty means the local stack's embedded directory.
    """

    url: Secret = Secret("")
    database: str = "megatrace"
    retention_days: int = 30
    #: the flow's own rows (aligned collectives, steps, verdicts) are inserted per table
    #: once this many are gathered or the oldest waited ``batch_ms``: ClickHouse wants few,
    #: large inserts (each makes a part), and a job's step makes one row of some tables
    batch_rows: int = 20_000
    batch_ms: int = 1_000
    #: the raw input records too, by ``batch_rows`` or after this long (shorter: they are
    #: what a dashboard shows first, and what end-to-end latency is measured on)
    raw_batch_ms: int = 200
    #: an insert that cannot reach ClickHouse is tried again for this long; then the flow
    #: stops, saying so, and resumes from its last snapshot when started again
    outage_wait_s: float = 300.0

    def __post_init__(self) -> None:
        if min(self.batch_rows, self.batch_ms, self.raw_batch_ms) < 1:
            raise ValueError(
                f"batch_rows, batch_ms and raw_batch_ms must be at least 1, not "
                f"{self.batch_rows}, {self.batch_ms} and {self.raw_batch_ms}"
            )
        if self.retention_days < 0 or self.outage_wait_s < 0:
            raise ValueError("retention_days and outage_wait_s cannot be negative")


class StackSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The local stack (broker process and embedded ClickHouse directory)."""

    state_dir: str = ".megatrace"
    broker_port: int = 0
    start_timeout_s: float = 15.0


class DetectSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Detector thresholds (defaults from the MEGATRACE paper where it gives one).

    ``hang_factor``: no progress for this many expected step times is a hang
    (paper: 1-2; or this many times a silence the job came out of lately, where that
    was longer: its present pace). ``min_shift``: smallest step-time increase called a slowdown
    (paper's operating point: below ~90% throughput; a rank of 64 computing 15%
    slower costs a pipeline job about 5%, and a job's own step-to-step noise raises
    the bar where it is noisier). ``node_margin``: a critical
    node is slow above expected x (1 + node_margin) (paper: 0.5 for its large
    injected delays; we localise 10% slowdowns, guarded by the step-time gate).
    ``alpha``: expected durations follow values within this fraction (paper: 0.05).
    ``link_drop``: a link is degraded below (1 - link_drop) x its baseline (paper: 0.2).
    ``link_wait_ms``: a confirmed step-time shift is localised once every node's link
    samples reached the step that confirmed it, or this long (event time) after it
    (a degraded link read late must not leave its slowdown to the job or to a rank).
    ``settle_s``: a step-time shift is reported only once it has lasted this long
    (event time): a host's own hiccups (the scheduler, memory reclaim, a collection
    pause) last up to about a second whatever the job's step; one over sooner is judged
    as a straggler's burst.
    ``transient_min_lost_ms``: a straggler for a step or a few is reported only where it
    cost the job this much time (a rank the host's scheduler kept waiting for a few of
    its time slices loses less; a GPU twice as slow for a step loses its step).
    ``save_hang_s``: while a rank saves a checkpoint (where heartbeats say so) the job's
    silence is a hang only past this long (PyTorch's default collective timeout: its
    peers wait for it at their next collective, as the job was written to).
    ``start_hang_s``: a start of the job (the first, or one started again) until its first
    collective completes is a hang only past this long: its ranks load the model and the
    data, and join their first collective at their own pace (PyTorch's default
    collective timeout).
    ``stall_hang_s``: a call every member joined, where no proxy operation shows its
    transfer waiting, is a hang only past this long (and past ``hang_factor``'s bar): a
    degraded link moves a large call's data many times slower than usual (a link
    throttled to a tenth took a mixture of experts' exchange a hundred times its usual
    time) and a transport retransmits over a link that drops packets for seconds before
    it gives up (NCCL's InfiniBand timeout, TCP's back-off); from the call's time alone
    the two are a stall that has not ended yet. Proxy operations that stopped moving
    are seen sooner.
    ``part_shards``: the flow merges the communicators' step parts under this many
    keys per job before the job's analysis (that step's parallelism).
    """

    warmup_steps: int = 5
    hang_factor: float = 2.0
    min_hang_ms: float = 500.0
    min_shift: float = 0.05
    persistence: int = 3
    node_margin: float = 0.1
    alpha: float = 0.05
    link_drop: float = 0.2
    host_lead_drop: float = 0.3
    partial_timeout_ms: float = 200.0
    link_wait_ms: float = 5000.0
    settle_s: float = 1.0
    transient_min_lost_ms: float = 50.0
    save_hang_s: float = 600.0
    start_hang_s: float = 600.0
    stall_hang_s: float = 5.0
    part_shards: int = 16

    def __post_init__(self) -> None:
        if self.part_shards < 1:
            raise ValueError(f"part_shards must be at least 1, not {self.part_shards}")


class WebhookSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One alert endpoint.

    ``format``: ``generic`` (the alert as JSON), ``slack`` (incoming webhook) or
    ``feishu`` (Feishu/Lark custom bot). ``min_level``: ``info``, ``warning`` or
    ``critical``; ``kinds``: verdict kinds to send (empty: all). ``secret``
    signs each request (HMAC-SHA256: an ``X-Megatrace-Signature`` header, or
    Feishu's own ``timestamp``/``sign`` fields). The URL is a secret too
    (Slack and Feishu put the token in it).
    """

    name: str
    url: Secret
    format: str = "generic"
    min_level: str = "info"
    kinds: list[str] = msgspec.field(default_factory=list)
    secret: Secret = Secret("")
    timeout_s: float = 5.0
    max_retries: int = 6
    backoff_s: float = 0.5
    max_backoff_s: float = 60.0

    def __post_init__(self) -> None:
        if self.format not in WEBHOOK_FORMATS:
            raise ValueError(
                f"webhook {self.name!r}: format {self.format!r} "
                f"(valid: {', '.join(WEBHOOK_FORMATS)})"
            )
        if self.min_level not in ALERT_LEVELS:
            raise ValueError(
                f"webhook {self.name!r}: min_level {self.min_level!r} "
                f"(valid: {', '.join(ALERT_LEVELS)})"
            )


WEBHOOK_FORMATS = ("generic", "slack", "feishu")
ALERT_LEVELS = ("info", "warning", "critical")


class AlertSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Alert delivery: endpoints, and when an incident is worth another message.

    In TOML, endpoints are ``[[alerts.webhooks]]`` tables; in the environment,
    ``MEGATRACE_ALERTS__WEBHOOKS`` holds them as a JSON list. An incident sends
    one alert when it opens, an update when its level changes or its severity
    moved by ``severity_step`` (at most every ``update_interval_s`` of job
    time), and one when it resolves. ``warning``/``critical``: severity
    (fraction of throughput lost) from which an incident has that level; hangs
    are always critical. ``queue_size``: alerts held per endpoint while it is
    slow or down (the oldest are dropped, and counted, beyond that).
    """

    webhooks: list[WebhookSettings] = msgspec.field(default_factory=list)
    warning: float = 0.05
    critical: float = 0.2
    severity_step: float = 0.1
    update_interval_s: float = 300.0
    max_incidents_per_hour: int = 20
    queue_size: int = 1000


class AgentSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The node agent (``megatrace agent``), one per GPU node.

    ``job``/``node`` are stamped on records that arrive without them (the NCCL
    plugin does not know the job; empty ``node`` means this host's name).
    ``socket``: the Unix datagram socket local producers send JSON lines to.
    ``tail``: globs of JSON-lines files to follow. ``inspector``: globs of the NCCL
    Inspector's output files to follow (``NCCL_INSPECTOR_DUMP_DIR``), turned into
    records; their job is ``job``. ``spool_dir``/``spool_max_mb``:
    the on-disk queue of accepted, undelivered records (full: new records are
    dropped and counted). ``health_file``: where health is written every
    ``health_interval_s``. ``socket``, ``spool_dir`` and ``health_file`` left empty
    are ``agent.sock``, ``spool/`` and ``agent-health.json`` in the stack's state
    directory (``stack.state_dir``). ``stall_s``: records in flight with no delivery
    for this long are taken back and sent again from the spool with a fresh
    producer (a wedged producer, e.g. after the broker lost its producer state).
    """

    job: str = ""
    node: str = ""
    socket: str = ""
    tail: list[str] = msgspec.field(default_factory=list)
    inspector: list[str] = msgspec.field(default_factory=list)
    spool_dir: str = ""
    spool_max_mb: int = 1024
    max_inflight: int = 50_000
    health_interval_s: float = 10.0
    health_file: str = ""
    stall_s: float = 20.0

    def __post_init__(self) -> None:
        if self.spool_max_mb < 1:
            raise ValueError(f"agent.spool_max_mb must be at least 1, not {self.spool_max_mb}")
        if self.max_inflight < 1 or self.health_interval_s <= 0 or self.stall_s <= 0:
            raise ValueError(
                "agent.max_inflight must be at least 1, health_interval_s and stall_s above 0"
            )

    def paths(self, state_dir: str | Path) -> AgentSettings:
        """These settings with the empty paths filled in under ``state_dir``."""
        base = Path(state_dir)
        return msgspec.structs.replace(
            self,
            socket=self.socket or str(base / "agent.sock"),
            spool_dir=self.spool_dir or str(base / "spool"),
            health_file=self.health_file or str(base / "agent-health.json"),
        )


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    kafka: KafkaSettings = KafkaSettings()
    clickhouse: ClickHouseSettings = ClickHouseSettings()
    stack: StackSettings = StackSettings()
    detect: DetectSettings = DetectSettings()
    alerts: AlertSettings = AlertSettings()
    agent: AgentSettings = AgentSettings()

    def public(self) -> dict[str, Any]:
        """A printable view with secrets masked and passwords removed from URLs."""
        shown = msgspec.to_builtins(self, enc_hook=_mask)
        _mask_webhooks(shown["alerts"], self.alerts)
        return shown


def _mask(obj: Any) -> Any:
    if isinstance(obj, Secret):
        return redact_url(obj.get()) if "://" in obj.get() else repr(obj)
    raise NotImplementedError(type(obj))


def _mask_webhooks(shown: dict[str, Any], alerts: AlertSettings) -> None:
    """A webhook's URL is masked whole past its host: its token may be any part of it."""
    for hook, settings in zip(shown.get("webhooks", []), alerts.webhooks, strict=True):
        hook["url"] = redact_url(settings.url.get(), whole_path=True)


def _dec_hook(tp: type, obj: Any) -> Any:
    if tp is Secret:
        if not isinstance(obj, str):
            raise ValueError("expected a string")
        return Secret(obj)
    raise NotImplementedError(tp)


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def _env_layer(env: Mapping[str, str]) -> dict[str, Any]:
    """``MEGATRACE_KAFKA__BOOTSTRAP_SERVERS=x`` -> ``{"kafka": {"bootstrap_servers": "x"}}``."""
    sections = {f.name: f for f in msgspec.structs.fields(Settings)}
    layer: dict[str, Any] = {}
    for name, value in env.items():
        if not name.startswith("MEGATRACE_") or "__" not in name:
            continue
        section, _, key = name[len("MEGATRACE_") :].lower().partition("__")
        if section not in sections:
            raise ConfigError(f"{name}: unknown section {section!r} (known: {', '.join(sections)})")
        typ = sections[section].type
        fields = {f.name: f.type for f in msgspec.structs.fields(typ)}
        if key not in fields:
            raise ConfigError(f"{name}: unknown setting {key!r} (known: {', '.join(fields)})")
        layer.setdefault(section, {})[key] = _parse_env_value(name, value, fields[key])
    return layer


def _parse_env_value(name: str, value: str, typ: Any) -> Any:
    if typ in (int, float):
        try:
            return typ(value)
        except ValueError:
            raise ConfigError(f"{name}={value!r}: expected {typ.__name__}") from None
    if typ is bool:
        return value.lower() in ("1", "true", "yes", "on")
    if getattr(typ, "__origin__", None) is list:
        if not value.lstrip().startswith("["):  # a plain comma-separated list
            return [v.strip() for v in value.split(",") if v.strip()]
        try:
            return msgspec.json.decode(value)
        except msgspec.DecodeError:
            raise ConfigError(f"{name}: expected a JSON list") from None
    if getattr(typ, "__origin__", None) is dict:
        pairs = [p.split("=", 1) for p in value.split(",") if p]
        return {k.strip(): v.strip() for k, v in pairs}
    return value


def config_file_path(explicit: str | None, env: Mapping[str, str], cwd: Path) -> Path | None:
    """Which config file applies (see the module docstring), or None."""
    if explicit:
        return Path(explicit)
    if env.get("MEGATRACE_CONFIG"):
        return Path(env["MEGATRACE_CONFIG"])
    candidate = cwd / "megatrace.toml"
    return candidate if candidate.is_file() else None


def load_settings(
    *,
    file: Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Build :class:`Settings` from the layers, highest precedence last."""
    data: dict[str, Any] = {}
    if file is not None:
        try:
            data = tomllib.loads(Path(file).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {file} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {file}: {e}") from None
    data = _merge(data, _env_layer(env or {}))
    data = _merge(data, overrides or {})
    try:
        return msgspec.convert(data, Settings, dec_hook=_dec_hook)
    except msgspec.ValidationError as e:
        raise ConfigError(f"invalid configuration: {e}") from None
