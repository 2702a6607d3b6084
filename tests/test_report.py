"""``megatrace report`` over the stored faulty job: one HTML file with the pictures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from megatrace.cli import cli
from megatrace.report import ReportError, load, write_report

pytestmark = pytest.mark.integration


def test_report_names_the_culprits_and_embeds_every_picture(
    ch: Any, story: dict, tmp_path: Path
) -> None:
    page = write_report(ch, story["db"], story["job"], tmp_path)
    text = page.read_text()
    assert text.count("data:image/png;base64,") == 4
    for needle in ("rank 5", "rank 15", "node-1/mlx5_2-&gt;node-2/mlx5_2", "ground truth"):
        assert needle in text
    pngs = sorted(p.name.removeprefix(story["job"] + "-") for p in tmp_path.glob("*.png"))
    assert pngs == ["critical_path.png", "lateness_heatmap.png", "links.png", "step_time.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in tmp_path.glob("*.png"))


def test_the_pictures_are_drawn_from_the_culprits_data(ch: Any, story: dict) -> None:
    d = load(ch, story["db"], story["job"])
    assert {v["rank"] for v in d.verdicts} == {5, 6, 15}  # boxed on the heat map
    bad_link = next(v["link"] for v in d.verdicts if v["link"])
    series = [r["throughput_gbps"] for r in d.links if r["link"] == bad_link]
    assert min(series) < 0.5 * max(series)  # drawn in red, at its drop
    assert d.critical[0]["node"] == "F0s0"


def test_an_unknown_job_is_a_clear_error(
    ch: Any, clickhouse_url: str, story: dict, tmp_path: Path
) -> None:
    with pytest.raises(ReportError, match="no steps stored for job 'nope'"):
        write_report(ch, story["db"], "nope", tmp_path)
    where = ["--clickhouse-url", clickhouse_url, "--database", story["db"]]
    res = CliRunner().invoke(cli, [*where, "report", "--job", "nope"])
    assert res.exit_code == 1 and "no steps stored for job 'nope'" in res.output
