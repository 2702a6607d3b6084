"""The command line: it lists its commands, masks secrets and exports the schema."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner

from megatrace.cli import cli
from schemas.config import Settings


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


def test_bench_pipeline_refuses_zero_runs_before_starting_anything() -> None:
    res = CliRunner().invoke(cli, ["bench", "pipeline", "--repeat", "0"])
    assert res.exit_code == 2 and "--repeat" in res.output and "x>=1" in res.output


def test_lab_refuses_too_few_steps_before_starting_anything() -> None:
    res = CliRunner().invoke(cli, ["lab", "--case", "ddp-healthy", "--steps", "10"])
    assert res.exit_code == 2 and "a case needs 30 steps or more" in res.output


def test_schema_export_writes_json_schema(tmp_path) -> None:
    out = tmp_path / "s.json"
    res = CliRunner().invoke(cli, ["schema", "export", "--out", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert {"Collective", "ProxySummary", "Heartbeat", "Verdict"} <= set(doc["$defs"])


@pytest.mark.integration
def test_the_readme_demo_names_every_injected_culprit_and_runs_again_cleanly(tmp_path) -> None:
    import itertools
    import re
    import subprocess
    import sys

    state = ["--state-dir", str(tmp_path / "stack")]
    try:
        # a second demo on the same stack stands alone: its flow reads its own records,
        # not the first one's again (the broker keeps them)
        for _ in range(2):
            res = subprocess.run(
                [sys.executable, "-m", "megatrace", *state, "demo"],
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert res.returncode == 0, res.stderr[-2000:]
            published = re.search(r"([\d,]+) records published", res.stdout)
            read = re.search(r"\(([\d,]+) records read\)", res.stdout)
            assert published and read and published[1] == read[1], res.stdout[-3000:]
            after = res.stdout.split("  found:\n")[1].splitlines()
            found = list(itertools.takewhile(lambda ln: ln.startswith("    "), after))
            assert found[0].strip() == "3 incidents:", res.stdout[-3000:]
            rows = {ln.split()[0]: ln for ln in found[2:]}  # kind -> its row in the table
            assert "node-1/mlx5_2->node-2/mlx5_2" in rows["link"]
            assert "rank 15 " in rows["slowdown"] and "rank 5 (GPU 1) on node-1" in rows["hang"]
            (hang_opened,) = [
                ln for ln in res.stdout.splitlines() if ln.startswith("[open") and "hang:" in ln
            ]
            assert "forward micro-batch 3" in hang_opened
            # a person reads one line per incident change that matters, not every revision
            told = [
                ln
                for ln in res.stdout.splitlines()
                if ln.startswith(("[open", "[update", "[resolved"))
            ]
            assert 3 <= len(told) <= 6, told
            # the hung step is closed without all its collectives (on a loaded machine a
            # step whose partition was read late may be given up on too)
            cut = re.search(r"(\d+) left out, closed without some of their collectives", res.stdout)
            assert cut and int(cut[1]) >= 1, res.stdout[-3000:]
            report = res.stdout.split("report with pictures: ")[1].split()[0]
            assert (tmp_path / "stack" / "reports").is_dir() and report.endswith(".html")
    finally:
        subprocess.run([sys.executable, "-m", "megatrace", *state, "stack", "down"], timeout=60)


def test_tables_from_an_older_version_are_an_error_that_says_what_to_do(tmp_path) -> None:
    """An embedded database whose table keys rows differently (an older megatrace): the
    command stops with a message naming the data folder, not a traceback."""
    import os
    import subprocess
    import sys

    from schemas.tables import TABLES

    env = {**os.environ, "MEGATRACE_STACK__STATE_DIR": str(tmp_path)}
    old = TABLES["collectives"].ddl("megatrace", 0).replace(", receiver)", ")")
    make_old = (
        "from infra.clickhouse import connect\n"
        f"c = connect('chdb://{tmp_path}/clickhouse')\n"
        "c.command('CREATE DATABASE megatrace')\n"
        f"c.command({old!r})\n"
    )
    subprocess.run([sys.executable, "-c", make_old], env=env, check=True, timeout=120)
    res = subprocess.run(
        [sys.executable, "-m", "megatrace", "db", "init"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 1
    assert "collectives exists with another key" in res.stderr
    assert f"{tmp_path}/clickhouse: remove that folder" in res.stderr
    assert "Traceback" not in res.stderr


def test_run_says_plainly_when_its_broker_or_topics_are_not_there(
    settings: Settings, tmp_path: Path
) -> None:
    """Before the flow starts (Bytewax's own error would be a page of traceback)."""
    import subprocess

    from infra.broker import free_port
    from tests.helpers import megatrace_cmd

    url = f"chdb://{tmp_path / 'ch'}"
    fresh = msgspec.structs.replace(settings.kafka, topic_prefix="never-made.")
    cmd = megatrace_cmd(msgspec.structs.replace(settings, kafka=fresh), url, "m", tmp_path, "run")
    res = subprocess.run([*cmd, "--once"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "topic never-made.meta, never-made.comm" in res.stderr
    assert "run `megatrace stack up`" in res.stderr

    away = f"127.0.0.1:{free_port()}"  # nobody listens there
    cmd[cmd.index("--bootstrap-servers") + 1] = away
    res = subprocess.run([*cmd, "--once"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert f"cannot reach Kafka at {away}" in res.stderr


def test_analyze_tells_each_incident_change_once_and_ends_with_a_table(tmp_path) -> None:
    """The demo's job offline: every revision stays in ``--json``; the console prints a line
    per change that matters and one summary table, with no unknown field spelt out."""
    from producers.sim.scenarios import build
    from schemas.codec import write_jsonl

    run = build("story", scale="demo", seed=0)
    write_jsonl(tmp_path / "records.jsonl", run.records(emit_kernels=False))
    runner = CliRunner()
    every = runner.invoke(cli, ["analyze", str(tmp_path), "--json"])
    assert every.exit_code == 0, every.output
    revisions = [json.loads(line) for line in every.output.splitlines()]
    incidents = {v["verdict_id"] for v in revisions}
    assert len(incidents) == 3 and len(revisions) > len(incidents)

    res = runner.invoke(cli, ["analyze", str(tmp_path)])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    told = [ln for ln in lines if ln.startswith("[")]
    assert len([ln for ln in told if ln.startswith("[open")]) == 3
    assert len(told) <= len(revisions), told
    table = lines[lines.index("3 incidents:") :]
    assert table[1].split() == ["kind", "culprit", "cause", "from", "step", "cost", "status"]
    assert {row.split()[0] for row in table[2:]} == {"link", "slowdown", "hang"}
    for bad in ("None", "1 ranks", " 1 collectives"):
        assert bad not in res.output


@pytest.mark.parametrize(("steps", "told"), [
    (8, "no incidents over 8 steps: too few to tell a slowdown (it takes 9)"),
    (9, "no incidents: the job looks healthy"),
])  # fmt: skip
def test_analyze_calls_a_job_healthy_only_over_steps_enough_to_tell(
    tmp_path, steps: int, told: str
) -> None:
    """A recording of a job's first few steps has no incident, but its detectors were
    still learning the job's usual step: it is not called healthy. With the steps a
    slowdown takes to be told (the warm-up's five, three more to confirm it, step 0
    being no step's time), it is."""
    from producers.sim.scenarios import build
    from schemas.codec import write_jsonl

    write_jsonl(tmp_path / "r.jsonl", build("healthy", scale="tiny", seed=0, steps=steps).records())
    res = CliRunner().invoke(cli, ["analyze", str(tmp_path / "r.jsonl")])
    assert res.exit_code == 0, res.output
    assert res.output.splitlines()[-1] == told


def test_analyze_over_kernels_alone_says_nothing_was_judged(tmp_path) -> None:
    """Kernels (a profiler trace's, CUPTI's) are stored, not judged: a job's kernels with
    none of its calls are no healthy job, and are not called one."""
    from producers.sim.scenarios import build
    from schemas.codec import write_jsonl
    from schemas.records import Kernel

    run = build("compute-hang", scale="tiny", seed=0, steps=20)
    kernels = [r for r in run.records(emit_kernels=True) if isinstance(r, Kernel)]
    assert kernels
    write_jsonl(tmp_path / "k.jsonl", kernels)
    res = CliRunner().invoke(cli, ["analyze", str(tmp_path / "k.jsonl")])
    assert res.exit_code == 0, res.output
    assert res.output.splitlines()[-1].startswith("nothing judged: the records hold no ")


def test_eval_scores_folders_of_recordings_each_and_together(tmp_path) -> None:
    """Two folders of labelled recordings (one case with a hang, one healthy): each folder
    gets its table, then one over both, with what the missed and found faults cost."""
    from producers.sim.scenarios import build
    from schemas.codec import write_jsonl

    for folder, scenario in (("a", "compute-hang"), ("b", "healthy")):
        run = build(scenario, scale="tiny", seed=0, steps=30)
        case = tmp_path / folder / scenario
        case.mkdir(parents=True)
        write_jsonl(case / "records.jsonl", run.records(emit_kernels=False))
        write_jsonl(case / "labels.jsonl", run.labels)
    folders = [arg for f in ("a", "b") for arg in ("--corpus", str(tmp_path / f))]
    res = CliRunner().invoke(cli, ["eval", "--no-simulator", "--no-baselines", *folders])
    assert res.exit_code == 0, res.output
    out = res.output
    assert (
        f"# corpus {tmp_path / 'a'} (1 cases)" in out
        and "# every corpus (2 folders, 2 cases)" in out
    )
    every = out.splitlines()[out.splitlines().index("# every corpus (2 folders, 2 cases)") :]
    hang = next(line.split() for line in every if line.startswith("hang "))
    assert hang[1:4] == ["1", "0", "0"] and hang[7] == "100%"  # TP, FP, FN; the culprit
    assert any(line.startswith("false alarms per 10,000 healthy steps: 0.0") for line in every)
