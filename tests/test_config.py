"""Settings precedence (defaults < file < env < flags) and secrets that never print."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from schemas.config import ConfigError, config_file_path, load_settings
from schemas.secrets import Secret


def test_precedence_file_then_env_then_flags(tmp_path: Path) -> None:
    f = tmp_path / "megatrace.toml"
    f.write_text(
        '[kafka]\nbootstrap_servers = "file:9092"\npartitions = 6\ntopic_prefix = "f."\n'
        "[clickhouse]\nretention_days = 9\n"
    )
    env = {"MEGATRACE_KAFKA__BOOTSTRAP_SERVERS": "env:9092", "MEGATRACE_KAFKA__PARTITIONS": "8"}
    s = load_settings(file=f, env=env, overrides={"kafka": {"partitions": 12}})
    assert s.kafka.bootstrap_servers == "env:9092"  # env beats file
    assert s.kafka.partitions == 12  # flag beats env
    assert s.kafka.topic_prefix == "f."  # file beats default
    assert s.clickhouse.retention_days == 9
    assert s.clickhouse.database == "megatrace"  # default


def test_config_file_discovery(tmp_path: Path) -> None:
    assert config_file_path(None, {}, tmp_path) is None
    (tmp_path / "megatrace.toml").write_text("")
    assert config_file_path(None, {}, tmp_path) == tmp_path / "megatrace.toml"
    assert config_file_path(None, {"MEGATRACE_CONFIG": "/x.toml"}, tmp_path) == Path("/x.toml")
    assert config_file_path("/y.toml", {"MEGATRACE_CONFIG": "/x.toml"}, tmp_path) == Path("/y.toml")


def test_secrets_never_print() -> None:
    s = load_settings(
        env={
            "MEGATRACE_KAFKA__SASL_PASSWORD": "hunter2",
            "MEGATRACE_CLICKHOUSE__URL": "http://bob:s3cret@ch:8123/db",
        }
    )
    assert s.kafka.sasl_password == Secret("hunter2")
    assert s.kafka.sasl_password.get() == "hunter2"
    text = repr(s) + str(s.public())
    assert "hunter2" not in text and "s3cret" not in text
    assert s.public()["clickhouse"]["url"] == "http://bob:***@ch:8123/db"


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"MEGATRACE_KAFKA__NOPE": "1"}, "unknown setting 'nope'"),
        ({"MEGATRACE_NOPE__X": "1"}, "unknown section 'nope'"),
        ({"MEGATRACE_KAFKA__PARTITIONS": "many"}, "expected int"),
        ({"MEGATRACE_DETECT__PART_SHARDS": "0"}, "part_shards must be at least 1"),
    ],
)
def test_bad_environment_is_a_clear_error(env: dict[str, str], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        load_settings(env=env)


def test_bad_file_is_a_clear_error(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("[kafka]\npartitions = 'x'\n")
    with pytest.raises(ConfigError, match="partitions"):
        load_settings(file=f)
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(file=tmp_path / "missing.toml")


def test_the_readme_configuration_example_is_a_valid_configuration(tmp_path: Path) -> None:
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    start = readme.index("```toml\n[kafka]") + len("```toml\n")
    example = tmp_path / "megatrace.toml"
    example.write_text(readme[start : readme.index("```", start)])
    s = load_settings(file=example, env={})
    assert s.kafka.bootstrap_servers == "kafka-1:9092,kafka-2:9092"
    assert s.kafka.outage_wait_s == 300


_AWKWARD_PASSWORDS = ["pa#ss-S3CRET", "pa/ss-S3CRET", "pa?ss-S3CRET", "p@ss-S3CRET", "S3CRET"]
_AWKWARD_HOOKS = [
    "https://hooks.example.com/S3CRET",  # the token is the only path segment
    "https://hooks.example.com/hook#S3CRET",  # in the fragment
    "https://hooks.example.com/hook?token=S3CRET",
    "https://S3CRET@hooks.example.com/",  # as the user
    "https://bot:S3CRET@hooks.example.com/",
    "https://open.feishu.cn/open-apis/bot/v2/hook/S3CRET",
    "https://hooks.slack.com/services/T0/B0/S3CRET",
]


@pytest.mark.parametrize("password", _AWKWARD_PASSWORDS)
def test_a_clickhouse_password_never_shows_whatever_it_holds(password: str, tmp_path) -> None:
    from click.testing import CliRunner

    from megatrace.cli import cli

    url = f"http://bob:{password}@ch.internal:8123/metrics"
    env = {"MEGATRACE_CLICKHOUSE__URL": url, "MEGATRACE_STACK__STATE_DIR": str(tmp_path)}
    for args in (["config", "show"], ["stack", "status"]):
        res = CliRunner().invoke(cli, args, env=env)
        assert res.exit_code == 0, res.output
        assert "S3CRET" not in res.output, (args, res.output)
        assert "ch.internal:8123" in res.output


@pytest.mark.parametrize("url", _AWKWARD_HOOKS)
def test_a_webhook_token_never_shows_wherever_it_sits(url: str) -> None:
    from click.testing import CliRunner

    from megatrace.cli import cli

    hooks = json.dumps([{"name": "oncall", "url": url, "secret": "S3CRET-sign"}])
    res = CliRunner().invoke(cli, ["config", "show"], env={"MEGATRACE_ALERTS__WEBHOOKS": hooks})
    assert res.exit_code == 0, res.output
    assert "S3CRET" not in res.output, res.output
    (shown,) = json.loads(res.output)["alerts"]["webhooks"]
    assert (
        "hooks.example.com" in shown["url"] or "feishu" in shown["url"] or "slack" in shown["url"]
    )
