"""Detection quality and cost: ``megatrace analyze``, ``eval``, ``lab`` and ``bench``."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click

from megatrace.cli_base import _Ctx, cli


@cli.command("analyze")
@click.argument("path", type=click.Path(exists=True))
@click.option(
    "--json", "as_json", is_flag=True, help="Every verdict revision, one per line, as JSON."
)
def analyze(path: str, as_json: bool) -> None:
    """Run the detectors over recorded records: a JSON-lines file, a folder holding one
    (`megatrace simulate`, `megatrace lab`), or a run of the original MEGATRACE collector
    read in place (as `megatrace import megatrace-logs` reads it; its job: the folder's
    name); any of these as a tar archive too (compressed or not)."""
    import tempfile

    from schemas.files import InputFileError, is_archive, unpack

    with tempfile.TemporaryDirectory(prefix="megatrace-") as tmp:
        try:
            p = unpack(path, Path(tmp)) if is_archive(path) else Path(path)
        except InputFileError as e:
            raise click.ClickException(str(e)) from None
        _analyze(p, as_json)


def _analyze(p: Path, as_json: bool) -> None:
    """:func:`analyze` on a folder or file."""
    from collections import Counter

    from detectors.console import IncidentLog
    from detectors.replay import Replay
    from detectors.route import POLL
    from producers.megatron_config import ConfigFormatError
    from schemas.codec import SchemaError, read_jsonl, records_file, verdict_json
    from schemas.files import InputFileError
    from schemas.results import StepSummary, Verdict

    log = IncidentLog()
    replay = Replay(poll=POLL, rows=False)  # batched as the flow batches its polls
    steps: Counter[str] = Counter()  # each job's steps closed
    try:
        kept = records_file(p) if p.is_dir() else p
        if kept is None:
            from producers.megatrace_run import import_dir

            records, report = import_dir(p, None, p.resolve().name)
            for line in report.lines_out():
                click.echo(f"  {line}", err=True)
        else:
            records = read_jsonl(kept, inputs=True)
        for out in replay.run(records):
            if not isinstance(out, Verdict):
                if isinstance(out, StepSummary):
                    steps[out.job] += 1
                continue
            if as_json:  # every revision, as the verdicts table keeps them
                click.echo(json.dumps(verdict_json(out)))
            elif (line := log.update(out)) is not None:
                click.echo(line)
    except (SchemaError, ConfigFormatError, InputFileError) as e:
        raise click.ClickException(str(e)) from None
    if not as_json:
        click.echo("")
        # with no collective call nor link sample read there was nothing to judge, and a
        # job's first steps are its usual, learnt: neither is a healthy job
        jobs = replay.jobs.values()
        least = max((a.slowdowns.steps_to_tell for a in jobs), default=0)
        fewest = min((steps[a.job] for a in jobs), default=None)
        judged = bool(replay.comms or replay.nodes)
        for line in log.summary(judged, fewest, least):
            click.echo(line)


@cli.command("eval")
@click.option("--scale", "scales", multiple=True, default=["tiny"], show_default=True)
@click.option("--seeds", default=3, show_default=True, help="Seeds per scenario.")
@click.option("--scenario", "names", multiple=True, help="Only these scenarios.")
@click.option(
    "--corpus",
    "corpora",
    multiple=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="A folder of labelled recordings (one folder per case with records.jsonl and "
    "labels.jsonl, as `megatrace lab` leaves them); repeatable.",
)
@click.option(
    "--simulator/--no-simulator",
    default=True,
    show_default=True,
    help="Score the simulator's catalogue too.",
)
@click.option(
    "--baselines/--no-baselines",
    default=True,
    show_default=True,
    help="Also score the peers' rules (HTA, NVRx, Flight Recorder, fixed threshold).",
)
@click.option("--ep", default=1, show_default=True, help="Expert parallelism of every job.")
@click.option("--cp", default=1, show_default=True, help="Context parallelism of every job.")
@click.option(
    "--heartbeat-p2p/--no-heartbeat-p2p",
    default=True,
    show_default=True,
    help="Heartbeats count transfers too (the PyTorch collector's); without, they count "
    "collectives only (the NCCL plugin's).",
)
@click.option(
    "--pp-group-comm",
    is_flag=True,
    help="Pipeline transfers on the pipeline group's communicator (batched sends), not on a "
    "communicator per pair of stages.",
)
def evaluate(
    scales: tuple[str, ...],
    seeds: int,
    names: tuple[str, ...],
    corpora: tuple[Path, ...],
    simulator: bool,
    baselines: bool,
    ep: int,
    cp: int,
    heartbeat_p2p: bool,
    pp_group_comm: bool,
) -> None:
    """Detection quality, megatrace beside its peers: on the simulator's labelled catalogue
    and on folders of labelled recordings (real jobs: the lab's, or any kept)."""
    from megatrace import evaluate as ev

    shape = {"ep": ep, "cp": cp, "heartbeat_p2p": heartbeat_p2p, "pp_group_comm": pp_group_comm}

    def said(name: str) -> None:
        if not sys.stderr.isatty():  # the bar only draws on a terminal: say each run
            click.echo(f"  {name}", err=True)

    if simulator:
        todo, make = ev.simulated(scales, names, seeds, shape, kernels=baselines)
        with click.progressbar(
            todo, label="scenarios", item_show_func=lambda x: x and f"{x[0]} {x[1]} seed {x[2]}"
        ) as bar:
            res = ev.score((make(x) for x in bar), baselines, said)
        click.echo("\n# simulator")
        for line in res.tables():
            click.echo(line)
    every = ev.Results()
    for root in corpora:
        try:
            cases = list(ev.corpus(root))
        except (FileNotFoundError, ValueError) as e:  # none; a file cut short, a bad line
            raise click.ClickException(str(e)) from None
        res = ev.score(cases, baselines, said)
        every.add(res)
        click.echo(f"\n# corpus {root} ({len(cases)} cases)")
        for line in res.tables():
            click.echo(line)
    if len(corpora) > 1:
        click.echo(f"\n# every corpus ({len(corpora)} folders, {every.cases} cases)")
        for line in every.tables():
            click.echo(line)


@cli.command("lab")
@click.option("--case", "names", multiple=True, help="Only these cases (default: all).")
@click.option("--quick", is_flag=True, help="The CI subset: a slow link, a slow rank, a hang, "
              "a healthy run.")  # fmt: skip
@click.option("--list", "listing", is_flag=True, help="List the cases and stop.")
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    help="Where each case's labelled recording goes (default: <state-dir>/lab-runs).",
)
@click.option("--steps", type=click.IntRange(min=1), help="Run every case for this many "
              "training steps (a soak: `--case ddp-healthy --steps 2500` measures false "
              "alarms over a real job's noise).")  # fmt: skip
@click.option("--baselines/--no-baselines", default=True, show_default=True)
@click.option("--cleanup", is_flag=True, help="Remove what a crashed lab left (namespaces, "
              "links, qdiscs, cgroups) and stop.")  # fmt: skip
@click.pass_obj
def lab(obj: _Ctx, names: tuple[str, ...], quick: bool, listing: bool, out: str | None,
        steps: int | None, baselines: bool, cleanup: bool) -> None:  # fmt: skip
    """Real distributed jobs (Gloo, CPU) on network-namespace nodes, faults injected by
    the operating system, scored like the simulator (needs root and PyTorch)."""
    from infra.netlab import LabError
    from infra.netlab import cleanup as lab_cleanup
    from megatrace.lab_cases import CASES, QUICK, too_few_steps

    if why := too_few_steps(steps):  # before anything starts
        raise click.BadParameter(why, param_hint="--steps")
    state = Path(obj.settings.stack.state_dir) / "lab"
    if cleanup:
        removed = lab_cleanup(state)
        click.echo(f"removed: {', '.join(removed)}" if removed else "nothing to remove")
        return
    if listing:
        for name, c in CASES.items():
            faults = ", ".join(f"{f.kind} of {f.target}" for f in c.faults) or "healthy"
            if c.checkpoint_every:
                faults += f", a checkpoint every {c.checkpoint_every} steps"
            if c.restart_at:
                faults += f", started again from step {c.restart_at}"
            click.echo(f"{name:<24} {c.workload:<9} {c.ranks} ranks, {faults}")
        return
    try:
        import torch  # noqa: F401
    except ImportError:
        raise click.ClickException(
            "the lab runs real PyTorch jobs: pip install torch==2.13.0 (the CPU build)"
        ) from None
    from megatrace.lab_run import run_lab, table

    chosen = list(names) or (list(QUICK) if quick else list(CASES))
    out_dir = Path(out) if out else Path(obj.settings.stack.state_dir) / "lab-runs"
    t0 = time.monotonic()
    try:
        runs = run_lab(obj.settings, chosen, out_dir, click.echo, steps=steps)
    except LabError as e:
        raise click.ClickException(str(e)) from None
    for line in table(runs, baselines):
        click.echo(line)
    click.echo(f"\n{len(runs)} cases in {time.monotonic() - t0:.0f} s; recordings in {out_dir}")


@cli.group()
def bench() -> None:
    """Benchmarks that print tables."""


@bench.command("codec")
@click.option("--records", default=200_000, show_default=True)
def bench_codec(records: int) -> None:
    """Decode throughput of json, orjson and msgspec on collective records."""
    from schemas.bench import codec_table

    for line in codec_table(records):
        click.echo(line)


@bench.command("pipeline")
@click.option("--steps", default=8, show_default=True, help="Iterations of the healthy job.")
@click.option("--scale", default="small", show_default=True)
@click.option("--rate", default=20_000, show_default=True, help="Records/s of the paced run.")
@click.option("--seconds", default=10.0, show_default=True, help="Length of the paced run.")
@click.option(
    "--repeat",
    default=3,
    type=click.IntRange(min=1),
    show_default=True,
    help="Runs of each throughput measure; the best is reported, beside the range.",
)
@click.pass_obj
def bench_pipeline(obj: _Ctx, **options: Any) -> None:
    """Raw consume+decode vs the full dataflow, and end-to-end latency, on this machine."""
    from megatrace.bench import pipeline

    pipeline(obj.settings, say=click.echo, **options)


@bench.command("faults")
@click.option("--lines", default=20_000, show_default=True, help="Hostile input lines.")
@click.option("--spool-trials", default=300, show_default=True, help="Spool damage trials.")
@click.option("--kills", default=3, show_default=True, help="kill -9 of the flow, then resumed.")
@click.option("--pills", default=200, show_default=True, help="Poison pills among a job's records.")
@click.option("--seed", default=0, show_default=True)
@click.pass_obj
def bench_faults(obj: _Ctx, **options: Any) -> None:
    """Hostile input and faults against the real components: what was tried, survived,
    lost and duplicated."""
    from megatrace.faults import faults

    rows = faults(obj.settings, say=click.echo, **options)
    if any(r.lost or r.survived < r.tried for r in rows):
        raise SystemExit(1)


@bench.command("collector")
@click.option("--calls", default=20_000, show_default=True)
def bench_collector(calls: int) -> None:
    """Overhead of the PyTorch collector per torch.distributed call."""
    from megatrace.bench_units import collector

    collector(calls, click.echo)


@bench.command("plugin")
@click.option("--events", default=200_000, show_default=True, help="Proxy-step state changes.")
def bench_plugin(events: int) -> None:
    """Cost per event of the NCCL profiler plugin's hot path (C, called as NCCL calls it)."""
    from megatrace.bench_units import plugin

    plugin(events, click.echo)


@bench.command("simulate")
@click.option(
    "--scale",
    "scales",
    multiple=True,
    default=["tiny", "small", "medium", "large"],
    show_default=True,
)
@click.option("--steps", default=2, show_default=True)
def bench_simulate(scales: tuple[str, ...], steps: int) -> None:
    """Simulator generation throughput per scale (one core)."""
    from megatrace.bench_units import simulate as sim_bench

    sim_bench(list(scales), steps, click.echo)


@bench.command("analyze")
@click.option("--scale", default="large", show_default=True)
@click.option("--steps", default=8, show_default=True)
def bench_analyze(scale: str, steps: int) -> None:
    """Detector cost per training step at a scale (4,096 ranks by default)."""
    from megatrace.bench_units import analyze as analyze_bench

    analyze_bench(scale, steps, click.echo)
