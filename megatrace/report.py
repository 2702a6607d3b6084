"""``megatrace report``: one self-contained HTML file (and PNGs) about one job.

Read from ClickHouse with the dashboards' own panel SQL (one home for each
question), drawn with matplotlib: the verdicts, step time with the incidents'
onsets, the rank x step lateness heat map with the culprits highlighted, the
critical path of the slowest step across the pipeline stages, and link
throughput with the degraded links highlighted. Injected ground truth, when
the job was simulated, is listed beside the verdicts.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infra.grafana.dashboards import JOB
from infra.grafana.model import ALL, expand

_WHOLE_RANGE = (0, 4_000_000_000)  # Unix seconds: every row of the job


class ReportError(RuntimeError):
    """The job has nothing to report (unknown job, or nothing stored yet)."""


@dataclass
class Figure:
    name: str
    title: str
    png: bytes
    caption: str = ""


@dataclass
class JobData:
    job: str
    verdicts: list[dict[str, Any]]
    labels: list[dict[str, Any]]
    steps: list[dict[str, Any]]
    lateness: list[dict[str, Any]]
    critical: list[dict[str, Any]]
    links: list[dict[str, Any]]
    figures: list[Figure] = field(default_factory=list)


def _rows(client: Any, sql: str) -> list[dict[str, Any]]:
    res = client.query(sql)
    return [dict(zip(res.column_names, r, strict=True)) for r in res.result_rows]


def load(client: Any, database: str, job: str) -> JobData:
    """Everything the report shows, from ClickHouse."""

    def panel(key: str) -> list[dict[str, Any]]:
        values = {"job": job, "node": ALL, "rank": ALL}
        return _rows(client, expand(JOB.panel(key).sql, values, _WHOLE_RANGE, database=database))

    steps = _rows(
        client,
        f"SELECT step, duration_ns / 1e6 AS step_ms, expected_ns / 1e6 AS expected_ms, "
        f"left_out AS incomplete "
        f"FROM {database}.steps FINAL WHERE job = '{_q(job)}' ORDER BY step",
    )
    if not steps:
        raise ReportError(f"no steps stored for job {job!r} in {database}: nothing to report")
    verdicts = panel("verdicts")
    link_names = {v["link"] for v in verdicts if v.get("link")}
    worst = _rows(
        client,
        f"SELECT link FROM {database}.link_minutes WHERE job = '{_q(job)}' "
        f"GROUP BY link ORDER BY min(min_gbps) / nullIf(max(max_gbps), 0) LIMIT 4",
    )
    link_names |= {r["link"] for r in worst}
    quoted = ",".join(f"'{_q(n)}'" for n in sorted(link_names)) or "''"
    links = _rows(
        client,
        f"SELECT (ts_ns - min(ts_ns) OVER ()) / 1e9 AS t_s, link, throughput_gbps FROM ("
        f"SELECT ts_ns, concat(node, '/', nic, '->', dst_node, '/', dst_nic) AS link, "
        f"throughput_gbps FROM {database}.link_samples FINAL WHERE job = '{_q(job)}') "
        f"WHERE link IN ({quoted}) ORDER BY t_s",
    )
    labels = _rows(
        client,
        f"SELECT kind, cause, rank, node, link, onset_step, phase, microbatch, "
        f"round(throughput_cost * 100, 1) AS cost_pct FROM {database}.fault_labels FINAL "
        f"WHERE job = '{_q(job)}' ORDER BY onset_step",
    )
    return JobData(
        job=job,
        verdicts=verdicts,
        labels=labels,
        steps=steps,
        lateness=panel("lateness_heatmap"),
        critical=panel("critical_path"),
        links=links,
    )


def _q(s: str) -> str:
    return s.replace("\\", "\\\\").replace("'", "\\'")


# --------------------------------------------------------------------------- pictures


def _png(fig: Any) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _culprit_ranks(d: JobData) -> dict[int, str]:
    return {v["rank"]: v["kind"] for v in d.verdicts if v.get("rank") is not None}


def step_figure(d: JobData) -> Figure:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 3.6))
    xs = [r["step"] for r in d.steps]
    ax.plot(xs, [r["step_ms"] for r in d.steps], marker=".", label="step time")
    exp = [(r["step"], r["expected_ms"]) for r in d.steps if r["expected_ms"] is not None]
    if exp:
        ax.plot(*zip(*exp, strict=True), ls="--", color="grey", label="expected")
    cut = [(r["step"], r["step_ms"]) for r in d.steps if r["incomplete"]]
    if cut:  # closed without some of its collectives: its time covers only what came
        ax.plot(*zip(*cut, strict=True), ls="", marker="x", color="black", label="incomplete")
    for v in d.verdicts:
        at = v["onset_step"] if v.get("onset_step") is not None else v.get("step")
        if at is not None:
            ax.axvline(at, color="red", alpha=0.6)
            ax.annotate(
                v["kind"],
                (at, ax.get_ylim()[1]),
                rotation=90,
                va="top",
                ha="right",
                color="red",
                fontsize=8,
            )
    ax.set_xlabel("training step")
    ax.set_ylabel("ms")
    ax.legend(loc="upper left")
    ax.set_title(f"{d.job}: step time, incidents at their onset step")
    return Figure("step_time", "Step time and incidents", _png(fig))


def heatmap_figure(d: JobData) -> Figure:
    import matplotlib.pyplot as plt
    import numpy as np

    steps = sorted({r["step"] for r in d.lateness})
    ranks = sorted({r["rank"] for r in d.lateness})
    grid = np.full((len(ranks), len(steps)), np.nan)
    si = {s: i for i, s in enumerate(steps)}
    ri = {r: i for i, r in enumerate(ranks)}
    for r in d.lateness:
        grid[ri[r["rank"]], si[r["step"]]] = r["lateness_ms"]
    lim = float(np.nanpercentile(np.abs(grid), 99)) or 1.0
    fig, ax = plt.subplots(figsize=(10, max(3.0, 0.22 * len(ranks) + 1)))
    im = ax.imshow(grid, aspect="auto", cmap="RdBu_r", vmin=-lim, vmax=lim, origin="lower")
    fig.colorbar(im, ax=ax, label="lateness (ms) vs TP group mean, per step")
    culprits = _culprit_ranks(d)
    ax.set_yticks(range(len(ranks)), [str(r) for r in ranks], fontsize=7)
    for label in ax.get_yticklabels():
        if int(label.get_text()) in culprits:
            label.set_color("red")
            label.set_fontweight("bold")
    for rank, kind in culprits.items():
        if rank in ri:
            y = ri[rank]
            ax.add_patch(plt.Rectangle((-0.5, y - 0.5), len(steps), 1, fill=False, ec="lime", lw=2))
            ax.annotate(
                f"rank {rank}: {kind}",
                (0, y),
                xytext=(4, 0),
                textcoords="offset points",
                va="center",
                fontsize=8,
                bbox={"boxstyle": "round", "fc": "white", "ec": "lime", "alpha": 0.85},
            )
    step_ticks = range(0, len(steps), max(1, len(steps) // 12))
    ax.set_xticks(list(step_ticks), [str(steps[i]) for i in step_ticks])
    ax.set_xlabel("training step")
    ax.set_ylabel("rank")
    ax.set_title("Lateness per rank and step (culprits boxed)")
    return Figure("lateness_heatmap", "Lateness heat map", _png(fig))


def critical_path_figure(d: JobData) -> Figure:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 3.2))
    nodes = [r["node"] for r in d.critical]
    step = d.critical[0]["step"] if d.critical else None
    pts = []
    for i, name in enumerate(nodes):
        kind, rest = name[0], name[1:]
        mb, _, stage = rest.partition("s")
        pts.append((i, int(stage) if stage.isdigit() else 0, kind, mb))
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color="grey", lw=1, zorder=1)
    for x, y, kind, mb in pts:
        color = "tab:blue" if kind == "F" else "tab:orange" if kind == "B" else "tab:green"
        ax.scatter(x, y, s=260, color=color, zorder=2)
        ax.annotate(f"{kind}{mb}", (x, y), ha="center", va="center", fontsize=7, color="white")
    slow = {v.get("pp_stage") for v in d.verdicts if v.get("pp_stage") is not None}
    for s in slow:
        ax.axhspan(s - 0.4, s + 0.4, color="red", alpha=0.12)
    ax.set_xlabel("position on the critical path")
    ax.set_ylabel("PP stage")
    ax.set_title(
        f"Critical path of the slowest step ({step}): F = forward, B = backward, "
        "stages of incidents shaded"
    )
    return Figure("critical_path", "Critical path of the slowest step", _png(fig))


def links_figure(d: JobData) -> Figure:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 3.6))
    flagged = {v["link"] for v in d.verdicts if v.get("link")}
    by_link: dict[str, list[tuple[float, float]]] = {}
    for r in d.links:
        by_link.setdefault(r["link"], []).append((r["t_s"], r["throughput_gbps"]))
    for name, pts in sorted(by_link.items()):
        bad = name in flagged
        ax.plot(
            *zip(*pts, strict=True),
            lw=2 if bad else 1,
            color="red" if bad else None,
            alpha=1 if bad else 0.6,
            label=f"{name} (incident)" if bad else name,
        )
    ax.set_xlabel("seconds since the first sample")
    ax.set_ylabel("Gb/s")
    ax.legend(fontsize=7, loc="lower left")
    ax.set_title("Link throughput: links with incidents and the worst others")
    return Figure("links", "Link throughput", _png(fig))


# --------------------------------------------------------------------------- HTML


def _table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join(
        "<tr>"
        + "".join(f"<td>{html.escape('' if r.get(c) is None else str(r[c]))}</td>" for c in cols)
        + "</tr>"
        for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def render_html(d: JobData) -> str:
    vcols = ["status", "kind", "cause", "node", "rank", "link", "onset_step", "step"]
    vcols += ["microbatch", "phase"]
    vcols += ["pp_stage", "lost_pct", "summary"]
    truth = ""
    if d.labels:
        cols = ["kind", "cause", "node", "rank", "link", "onset_step", "phase", "microbatch"]
        truth = "<h2>Injected ground truth (simulation)</h2>" + _table(
            d.labels, [*cols, "cost_pct"]
        )
    figs = "".join(
        f"<h2>{html.escape(f.title)}</h2><img alt='{html.escape(f.title)}' "
        f"src='data:image/png;base64,{base64.b64encode(f.png).decode()}'/>"
        for f in d.figures
    )
    mean = sum(r["step_ms"] for r in d.steps) / len(d.steps)
    return f"""<!doctype html><html><head><meta charset="utf-8">
<title>megatrace report: {html.escape(d.job)}</title>
<style>body{{font-family:sans-serif;max-width:1150px;margin:auto}}
table{{border-collapse:collapse;font-size:13px}}td,th{{border:1px solid #ccc;padding:3px 6px}}
img{{max-width:100%}}</style></head><body>
<h1>megatrace report: {html.escape(d.job)}</h1>
<p>{len(d.steps)} steps analysed (mean {mean:.1f} ms), {len(d.verdicts)} incidents.</p>
<h2>Verdicts</h2>{_table(d.verdicts, vcols) if d.verdicts else "<p>none: healthy</p>"}
{truth}{figs}</body></html>
"""


def write_report(
    client: Any,
    database: str,
    job: str,
    out_dir: Path,
    say: Callable[[str], None] = lambda _: None,
) -> Path:
    """Write ``<out_dir>/<job>.html`` and one PNG per figure; return the HTML path."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no screen
    d = load(client, database, job)
    makers = [step_figure, heatmap_figure]
    if d.critical:
        makers.append(critical_path_figure)
    if d.links:
        makers.append(links_figure)
    out_dir.mkdir(parents=True, exist_ok=True)
    for make in makers:
        fig = make(d)
        d.figures.append(fig)
        path = out_dir / f"{job}-{fig.name}.png"
        path.write_bytes(fig.png)
        say(f"  {path}")
    page = out_dir / f"{job}.html"
    page.write_text(render_html(d))
    return page


__all__ = ["ReportError", "load", "render_html", "write_report"]
