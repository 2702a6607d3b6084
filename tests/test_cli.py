"""The command line: it lists its commands, masks secrets and exports the schema."""

from __future__ import annotations

import json

from click.testing import CliRunner

from megatrace.cli import cli


def test_help_lists_the_commands() -> None:
    out = CliRunner().invoke(cli, ["--help"]).output
    for command in ("demo", "run", "stack", "db", "schema", "config", "bench", "deadletters"):
        assert command in out


def test_config_show_masks_secrets_and_applies_flags() -> None:
    res = CliRunner().invoke(
        cli,
        ["--bootstrap-servers", "flag:9092", "config", "show"],
        env={
            "MEGATRACE_KAFKA__SASL_PASSWORD": "pw-123",
            "MEGATRACE_KAFKA__BOOTSTRAP_SERVERS": "e:1",
        },
    )
    assert res.exit_code == 0, res.output
    shown = json.loads(res.output)
    assert shown["kafka"]["bootstrap_servers"] == "flag:9092"
    assert "pw-123" not in res.output


def test_bad_config_is_a_usage_error_not_a_traceback() -> None:
    res = CliRunner().invoke(cli, ["config", "show"], env={"MEGATRACE_KAFKA__PARTITIONS": "lots"})
    assert res.exit_code == 2
    assert "expected int" in res.output


def test_schema_export_writes_json_schema(tmp_path) -> None:
    out = tmp_path / "s.json"
    res = CliRunner().invoke(cli, ["schema", "export", "--out", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert {"Collective", "ProxySummary", "Heartbeat", "Verdict"} <= set(doc["$defs"])
