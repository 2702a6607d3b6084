"""``megatrace import``: records from real sources, one-shot (or followed)."""

from __future__ import annotations

from pathlib import Path

import click

from megatrace.cli_base import _Ctx, _publish, _stop_on_signal, cli


@cli.group("import")
def import_() -> None:
    """Import records from real sources (one-shot)."""


@import_.command("kineto")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--job", required=True, help="Job id to give the records.")
@click.option("--node", default="unknown", show_default=True, help="Host the traces came from.")
@click.option(
    "--to", "to", default="kafka", show_default=True, help="'kafka' or a JSON-lines file."
)
@click.pass_obj
def import_kineto(obj: _Ctx, paths: tuple[str, ...], job: str, node: str, to: str) -> None:
    """PyTorch profiler (Kineto) traces: CUPTI kernels and NCCL kernel metadata."""
    from producers.kineto import TraceError, read_kineto
    from schemas.codec import write_jsonl

    def records():
        for p in paths:
            yield from read_kineto(Path(p), job=job, node=node)

    try:
        if to == "kafka":
            n = _publish(obj, records(), "publishing")
        else:
            n = write_jsonl(Path(to), records())
    except TraceError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"{n} records from {len(paths)} trace(s)")


@import_.command("megatrace-logs")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--config",
    "megatron_config",
    type=click.Path(exists=True),
    help="Megatron's arguments (JSON, YAML, a text of --flags, its training log) or the "
    "MEGATRACE analyser's config.yaml; by default the training log or config.yaml found in "
    "DIRECTORY.",
)
@click.option("--job", required=True, help="Job id to give the records.")
@click.option("--world-size", type=int, help="If the configuration does not say.")
@click.option(
    "--to",
    default="kafka",
    show_default=True,
    help="'kafka', or a JSON-lines file for `megatrace analyze`.",
)
@click.option("--follow", is_flag=True, help="Keep tailing the growing logs (to Kafka).")
@click.pass_obj
def import_megatrace_logs(
    obj: _Ctx,
    directory: str,
    megatron_config: str | None,
    job: str,
    world_size: int | None,
    to: str,
    follow: bool,
) -> None:
    """A run of the original MEGATRACE collector as it leaves it: per-rank call logs (any
    variant), per-NIC throughput CSVs, Megatron's training log (its iteration clock);
    other files and lines are skipped and named."""
    from producers.megatrace_logs import MegatraceLogReader
    from producers.megatrace_run import RunReport, follow_dir, import_dir, survey
    from producers.megatron_config import (
        ConfigFormatError,
        config_from_arguments,
        read_megatron_config,
        read_training_log,
    )
    from schemas.codec import write_jsonl
    from schemas.files import InputFileError

    report = RunReport()
    try:
        cfg = read_megatron_config(Path(megatron_config), world_size) if megatron_config else None
        if follow:
            if to != "kafka":
                raise click.UsageError("--follow publishes to Kafka (leave --to out)")
            from infra.kafka import producer_config
            from producers.publish import KafkaPublisher

            if cfg is None:  # the training log's arguments, or a config.yaml beside the logs
                files = survey(Path(directory), RunReport())
                if files.training is not None:
                    args = read_training_log(files.training).arguments
                    cfg = config_from_arguments(args, str(files.training), world_size)
                elif files.configs:
                    cfg = read_megatron_config(files.configs[0], world_size)
                else:
                    raise click.UsageError(
                        "no training log or config.yaml in the directory yet: give --config"
                    )
            st = obj.stack()
            pub = KafkaPublisher(producer_config(obj.settings.kafka, st.bootstrap()), st.topics)
            reader = MegatraceLogReader(cfg, job, eager=True)
            stopping = _stop_on_signal()
            click.echo(f"following {directory} (Ctrl-C to stop)", err=True)
            n = follow_dir(Path(directory), reader, pub.publish_all, stopping.is_set,
                           report=report)  # fmt: skip
            pub.flush()
        else:
            records, report = import_dir(Path(directory), cfg, job, world_size)
            n = (
                _publish(obj, records, "publishing")
                if to == "kafka"
                else write_jsonl(Path(to), records)
            )
    except (ConfigFormatError, InputFileError) as e:
        raise click.ClickException(str(e)) from None
    what = "call lines" if follow else "records"
    click.echo(f"{n:,} {what} from {report.call_logs or 'the'} call logs in {directory}")
    for line in report.lines_out():
        click.echo(f"  {line}")


@import_.command("nccl-inspector")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--job", required=True, help="Job id to give the records.")
@click.option(
    "--to", "to", default="kafka", show_default=True, help="'kafka' or a JSON-lines file."
)
@click.pass_obj
def import_nccl_inspector(obj: _Ctx, paths: tuple[str, ...], job: str, to: str) -> None:
    """The NCCL Inspector's JSON output (files, or directories of them): collectives,
    transfers and proxy operations of every rank, for jobs that run the Inspector."""
    from producers.nccl_inspector import InspectorFormatError, import_files
    from schemas.codec import write_jsonl

    try:
        records, reader = import_files(map(Path, paths), job)
    except InspectorFormatError as e:
        raise click.ClickException(str(e)) from None
    n = _publish(obj, records, "publishing") if to == "kafka" else write_jsonl(Path(to), records)
    click.echo(f"{n:,} records from the Inspector's output")
    for why, count in sorted(reader.skipped.items()):
        click.echo(f"  skipped: {why} ({count:,})")
    if reader.dropped:
        click.echo(f"  the Inspector overwrote {reader.dropped:,} operations before dumping them")
    if reader.numbered:
        click.echo(
            "  inferred: ranks numbered by host and process id (no communicator holds every "
            "process, and the Inspector names no global rank)"
        )


@import_.command("flight-recorder")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--job", required=True, help="Job id to give the records.")
@click.option(
    "--config",
    "megatron_config",
    type=click.Path(exists=True),
    help="Megatron arguments (JSON, YAML or --flags): places the hang in the schedule.",
)
@click.option(
    "--world-size",
    type=click.IntRange(min=1),
    help="The job's ranks, where no --config says (a rank that wrote no dump, past the "
    "highest that did, is known only so).",
)
@click.option(
    "--to",
    default="kafka",
    show_default=True,
    help="'kafka', or a JSON-lines file for `megatrace analyze`.",
)
@click.pass_obj
def import_flight_recorder(
    obj: _Ctx,
    paths: tuple[str, ...],
    job: str,
    megatron_config: str | None,
    world_size: int | None,
    to: str,
) -> None:
    """PyTorch Flight Recorder dumps (one file per rank, or a directory of them)."""
    from producers.flight_recorder import DumpFormatError, import_dumps
    from producers.megatron_config import ConfigFormatError as LogFormatError
    from producers.megatron_config import MegatronConfig, read_megatron_config
    from schemas.codec import write_jsonl

    files = [f for p in map(Path, paths) for f in (sorted(p.iterdir()) if p.is_dir() else [p])]
    try:
        cfg = read_megatron_config(Path(megatron_config)) if megatron_config else None
        if cfg is None and world_size is not None:
            cfg = MegatronConfig(world_size=world_size)
        records, skipped = import_dumps(files, job, cfg)
    except (DumpFormatError, LogFormatError) as e:
        raise click.ClickException(str(e)) from None
    n = _publish(obj, records, "publishing") if to == "kafka" else write_jsonl(Path(to), records)
    click.echo(f"{n} records from {len(files)} dump(s)")
    for what, count in sorted(skipped.items()):
        click.echo(f"  skipped: {what} ({count} entries)")
