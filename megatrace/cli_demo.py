"""Simulated jobs and what a user looks at: ``megatrace scenarios``, ``simulate``,
``demo`` and ``report``."""

from __future__ import annotations

import time
from pathlib import Path

import click

from megatrace.cli_base import _Ctx, _flow_config, _flow_errors_are_one_line, _publish, _redact, cli


@cli.command("scenarios")
def scenarios() -> None:
    """List the simulator's scenarios and scales."""
    from producers.sim.scenarios import SCALES, SCENARIOS

    for name, sdef in SCENARIOS.items():
        click.echo(f"{name:<18} {sdef.description} ({sdef.steps} steps)")
    click.echo(
        "scales: "
        + ", ".join(
            f"{n} (tp{tp} pp{pp} dp{dp} = {tp * pp * dp} ranks)"
            for n, (tp, pp, dp, *_rest) in SCALES.items()
        )
    )


@cli.command("simulate")
@click.option("--scenario", default="story", show_default=True)
@click.option("--scale", default="tiny", show_default=True)
@click.option("--tp", type=int)
@click.option("--pp", type=int)
@click.option("--dp", type=int)
@click.option("--ep", type=int, help="Expert parallelism (MoE AllToAll); must divide dp.")
@click.option(
    "--cp", type=int, help="Context parallelism (keys/values gathered per layer); ranks x cp."
)
@click.option("--steps", type=int, help="Iterations (default: the scenario's).")
@click.option("--seed", default=0, show_default=True)
@click.option("--no-kernels", is_flag=True, help="Leave out CUPTI kernel records.")
@click.option("--to", "to", default="kafka", show_default=True, help="'kafka' or a directory.")
@click.option("--paced", is_flag=True, help="Publish at the pace of the timestamps.")
@click.option("--speed", default=1.0, show_default=True, help="Pace multiplier with --paced.")
@click.pass_obj
def simulate(
    obj: _Ctx,
    scenario: str,
    scale: str,
    tp: int | None,
    pp: int | None,
    dp: int | None,
    ep: int | None,
    cp: int | None,
    steps: int | None,
    seed: int,
    no_kernels: bool,
    to: str,
    paced: bool,
    speed: float,
) -> None:
    """Simulate a training job with injected faults; publish it or write it to files."""
    from producers.publish import paced_by_time
    from producers.sim.scenarios import build
    from schemas.codec import write_jsonl

    over = {k: v for k, v in {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp}.items() if v}
    if no_kernels:
        over["kernels"] = False
    try:
        run = build(scenario, scale=scale, seed=seed, steps=steps, now=True, **over)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    sp = run.spec
    click.echo(
        f"job {sp.job}: {sp.world_size} ranks (tp{sp.tp} pp{sp.pp} dp{sp.dp}"
        f"{f' ep{sp.ep}' if sp.ep > 1 else ''}{f' cp{sp.cp}' if sp.cp > 1 else ''}) on "
        f"{sp.num_nodes} nodes, {run.steps} steps, faults: {run.faults or 'none'}"
    )
    records = paced_by_time(run.records(), speed) if paced else run.records()
    t0 = time.monotonic()
    if to == "kafka":
        n = _publish(obj, records, "publishing")
    else:
        out = Path(to)
        out.mkdir(parents=True, exist_ok=True)
        n = write_jsonl(out / "records.jsonl", records)
        write_jsonl(out / "labels.jsonl", run.labels)
        click.echo(f"wrote {out / 'records.jsonl'} and {out / 'labels.jsonl'}")
    dt = time.monotonic() - t0
    click.echo(f"{n} records in {dt:.1f}s ({n / dt:,.0f} records/s)")
    for lab in run.labels:
        click.echo(
            f"  truth: {lab.kind.value} {lab.cause.value} rank={lab.rank} "
            f"node={lab.node} link={lab.link} step={lab.onset_step} "
            f"cost={lab.throughput_cost:.0%}"
        )


@cli.command("demo")
@click.option("--scenario", default="story", show_default=True)
@click.option("--scale", default="demo", show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.pass_obj
def demo(obj: _Ctx, scenario: str, scale: str, seed: int) -> None:
    """The main job: a simulated cluster with injected faults, end to end on the local stack."""
    from bytewax.testing import run_main

    from detectors.console import summary_table
    from detectors.texts import plural
    from flows.main import build_flow
    from infra.clickhouse import insert_records, read_records
    from infra.queries import align_account, step_account
    from producers.sim.scenarios import build

    s = obj.stack()
    s.up()
    click.echo(f"[1/4] stack up: broker {s.bootstrap()}, clickhouse {_redact(s.clickhouse_url())}")
    # a job id of its own per run, so a second demo on the same stack stands alone
    job = f"{scenario}-{scale}-s{seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    run = build(scenario, scale=scale, seed=seed, now=True, job=job)
    sp = run.spec
    click.echo(
        f"[2/4] simulating {sp.job}: {sp.world_size} ranks (tp{sp.tp} pp{sp.pp} "
        f"dp{sp.dp}) on {sp.num_nodes} nodes, {run.steps} steps, "
        f"{len(run.faults)} injected faults"
    )
    # the flow reads this run's records only (the local broker keeps earlier demos' too)
    starts: dict[str, int] = {}
    n = _publish(obj, run.records(), "      publishing", starts)
    click.echo(f"      {n:,} records published")
    client = s.clickhouse()
    db_name = obj.settings.clickhouse.database
    insert_records(client, db_name, run.labels)
    click.echo("[3/4] dataflow: decode -> align -> analyse -> ClickHouse (verdicts as they come)")
    t0 = time.monotonic()
    polls: list[int] = []  # records per poll
    with _flow_errors_are_one_line():
        run_main(
            build_flow(_flow_config(obj, tail=False, start_offsets=starts, on_read=polls.append))
        )
    click.echo(f"      done in {time.monotonic() - t0:.1f} s ({sum(polls):,} records read)")
    click.echo("[4/4] verdicts in ClickHouse beside the injected ground truth:")
    verdicts = list(
        read_records(
            client, db_name, "verdicts", "job = {j:String}", {"j": sp.job}, order_by="onset_ns"
        )
    )
    click.echo("  injected:")
    for lab in run.labels:
        where = lab.link or (f"rank {lab.rank}" if lab.rank is not None else lab.node)
        kind, cause = lab.kind.value.replace("_", " "), lab.cause.value.replace("_", " ")
        click.echo(
            f"    {kind} of {where} ({cause}) from step {lab.onset_step}, "
            f"cost {lab.throughput_cost:.0%}"
        )
    click.echo("  found:")
    for line in summary_table(verdicts):
        click.echo(f"    {line}")
    st = step_account(client, db_name, sp.job)
    click.echo(
        f"  {plural(st.steps, 'step')} analysed (mean {st.mean_ms} ms; {st.cut:,} left out, "
        f"closed without some of their collectives or paused by the job, "
        f"{plural(st.after_close, 'collective')} came after "
        f"their step closed); query them in {_redact(s.clickhouse_url())} database {db_name}"
    )
    al = align_account(client, db_name, sp.job)
    click.echo(
        f"  alignment: {plural(al.records, 'collective record')} on "
        f"{plural(al.comms, 'communicator')}, {al.late:,} late, {al.out_of_order:,} out of "
        f"order, {plural(al.partial, 'collective')} reported partial"
    )
    from megatrace.report import write_report

    page = write_report(client, db_name, sp.job, Path(obj.settings.stack.state_dir) / "reports")
    click.echo(f"  report with pictures: {page}")
    click.echo(
        "  the local stack stays up for queries and reports (`megatrace stack status`); "
        "`megatrace stack down` stops it"
    )


@cli.command("report")
@click.option("--job", required=True, help="The job to report on.")
@click.option(
    "--out", default=None, help="Directory for the HTML and PNGs (default: <state-dir>/reports)."
)
@click.pass_obj
def report(obj: _Ctx, job: str, out: str | None) -> None:
    """One self-contained HTML file (and PNGs) about a job, from ClickHouse."""
    from megatrace.report import ReportError, write_report

    out_dir = Path(out) if out else Path(obj.settings.stack.state_dir) / "reports"
    try:
        page = write_report(
            obj.stack().clickhouse(),
            obj.settings.clickhouse.database,
            job,
            out_dir,
            say=click.echo,
        )
    except ReportError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"report: {page}")
