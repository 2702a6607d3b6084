"""The deployment files parse, and every command and variable in them is one we have."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from megatrace.cli import cli
from schemas.config import ConfigError, load_settings

ROOT = Path(__file__).parent.parent
DEPLOY = ROOT / "infra" / "deploy"


def check_command(args: list[str]) -> click.Command:
    """Parse a megatrace command line the way the CLI would (options and arguments
    checked, nothing run); return the leaf command."""
    cmd: click.Command = cli
    ctx = cmd.make_context("megatrace", list(args), resilient_parsing=False)
    while isinstance(cmd, click.Group):
        rest = [*ctx._protected_args, *ctx.args]
        if not rest:
            raise AssertionError(f"{args}: no subcommand")
        sub = cmd.get_command(ctx, rest[0])
        if sub is None:
            raise AssertionError(f"{args}: unknown command {rest[0]!r}")
        ctx = sub.make_context(rest[0], rest[1:], parent=ctx)
        cmd = sub
    return cmd


def env_of(service: dict[str, Any]) -> dict[str, str]:
    """The environment a compose service gets (env files read from their examples)."""
    files = service.get("env_file") or []
    env: dict[str, str] = {}
    for f in [files] if isinstance(files, str) else files:
        env.update(parse_env_file(DEPLOY / f"{f}.example"))
    env.update({k: str(v) for k, v in (service.get("environment") or {}).items()})
    return env


def parse_env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            k, _, v = line.partition("=")
            out[k.strip()] = v.strip()
    return out


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def test_compose_has_the_whole_deployment(compose: dict) -> None:
    assert {
        "kafka",
        "clickhouse",
        "grafana",
        "init",
        "flow-0",
        "flow-1",
        "store-0",
        "agent",
    } <= set(compose["services"])
    kafka = compose["services"]["kafka"]["environment"]
    assert "controller" in kafka["KAFKA_PROCESS_ROLES"]  # KRaft, no ZooKeeper


def test_every_megatrace_service_runs_a_real_command_with_real_settings(compose: dict) -> None:
    megatrace = {
        n: s for n, s in compose["services"].items() if s.get("image") == "megatrace:latest"
    }
    assert len(megatrace) == 5  # init, flow-0, flow-1, store-0, agent
    for name, service in megatrace.items():
        leaf = check_command(service["command"])
        assert leaf.name in {"up", "run", "agent"}, name
        env = env_of(service)
        assert env["MEGATRACE_KAFKA__BOOTSTRAP_SERVERS"] == "kafka:9092"
        settings = load_settings(env=env)  # unknown sections/keys raise ConfigError
        assert settings.clickhouse.url.get().startswith("http://")
        assert settings.alerts.webhooks[0].format == "slack"


def test_the_flow_processes_form_one_cluster(compose: dict) -> None:
    """Detection is one two-process cluster; raw storage runs beside it, so every input
    topic is both stored and analysed."""
    roles = {
        name: svc["command"][svc["command"].index("--role") + 1]
        for name, svc in compose["services"].items()
        if svc.get("command", [None])[0] == "run"
    }
    assert roles == {"flow-0": "detect", "flow-1": "detect", "store-0": "store"}
    dirs = [
        svc["command"]
        for svc in compose["services"].values()
        if "--recovery-dir" in svc.get("command", [])
    ]
    assert len({c[c.index("--recovery-dir") + 1] for c in dirs}) == len(dirs) == 3
    flows = [compose["services"][f"flow-{i}"]["command"] for i in range(2)]
    addresses = {c[c.index("--addresses") + 1] for c in flows}
    assert len(addresses) == 1
    assert [c[c.index("--process-id") + 1] for c in flows] == ["0", "1"]
    hosts = next(iter(addresses)).split(";")
    assert [h.split(":")[0] for h in hosts] == ["flow-0", "flow-1"]


def test_grafana_mounts_our_provisioning_and_dashboards(compose: dict) -> None:
    for volume in compose["services"]["grafana"]["volumes"]:
        src = (DEPLOY / volume.split(":")[0]).resolve()
        assert src.is_dir() and any(src.iterdir()), src
    env = compose["services"]["grafana"]["environment"]
    datasource = (ROOT / "infra/grafana/provisioning/datasources/clickhouse.yaml").read_text()
    for var in ("CLICKHOUSE_HOST", "CLICKHOUSE_USER", "CLICKHOUSE_PASSWORD"):
        assert var in env and "${" + var + "}" in datasource


def test_the_systemd_unit_runs_the_agent() -> None:
    unit = (DEPLOY / "megatrace-agent.service").read_text()
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    args = shlex.split(exec_start.removeprefix("ExecStart="))
    assert Path(args[0]).name == "megatrace"
    assert check_command(args[1:]).name == "agent"
    env = [line.split("=", 1)[1] for line in unit.splitlines() if line.startswith("Environment=")]
    load_settings(env=dict(e.split("=", 1) for e in env))


def test_a_wrong_command_or_variable_would_be_caught() -> None:
    with pytest.raises(click.UsageError):
        check_command(["run", "--no-such-flag"])
    with pytest.raises(ConfigError):
        load_settings(env={"MEGATRACE_KAFKA__BOOTSTRAP": "x"})


def test_the_image_copies_every_package() -> None:
    copied = {
        line.split()[1]
        for line in (DEPLOY / "Dockerfile").read_text().splitlines()
        if line.startswith("COPY ")
    }
    for pkg in ("schemas", "producers", "flows", "detectors", "infra", "megatrace"):
        assert pkg in copied and (ROOT / pkg / "__init__.py").exists()
