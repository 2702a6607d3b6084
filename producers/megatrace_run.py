"""A run of the original MEGATRACE collector, as the tool leaves it in a directory.

A run directory holds, side by side: one call log per rank (``rank_N.log``, any name:
files are told apart by what they hold), the NICs' throughput logs
(:mod:`producers.megatrace_links`), Megatron's
training log (``training_performance.log``: its ``arguments`` block is the run's own
configuration, its iteration lines the job's iteration clock), and perhaps the
analyser's ``config.yaml``. :func:`import_dir` reads it all as it is found: a file
that is none of these, and a line of a call log that is not a call, is skipped,
counted and named in the :class:`RunReport`, never fatal. :func:`follow_dir` tails a
run directory as it grows.

The configuration comes, in order of preference, from the one given, the training
log's arguments, or a ``config.yaml`` in the directory.
"""

from __future__ import annotations

import heapq
import operator
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from producers.megatrace_lines import CallLine, LogFormatError, parse_line, parse_text
from producers.megatrace_links import LINK_COLUMNS, link_samples, read_link_csv
from producers.megatrace_logs import MegatraceLogReader
from producers.megatron_config import (
    ConfigFormatError,
    MegatronConfig,
    TrainingLog,
    config_from_arguments,
    iteration_marks,
    parse_training_log,
    read_megatron_config,
    read_training_log,
)
from producers.tail import new_lines
from schemas.files import (
    STREAM_ERRORS,
    InputFileError,
    compression,
    inner_suffix,
    open_text,
    read_text,
)
from schemas.records import CommInfo, JobInfo, LinkSample, RankInfo

#: how far into a file its kind is decided (a training log's arguments come after some
#: hundreds of lines of start-up messages)
_SNIFF_LINES = 4000


@dataclass
class RunReport:
    """What an import read, inferred and left out."""

    call_logs: int = 0
    lines: int = 0
    inferred: Counter[str] = field(default_factory=Counter)
    skipped_files: dict[str, str] = field(default_factory=dict)  # file -> why
    skipped_lines: Counter[str] = field(default_factory=Counter)  # file -> how many
    bad_rows: Counter[str] = field(default_factory=Counter)  # throughput log -> how many
    link_samples: int = 0
    config_from: str = ""
    training_log: str = ""
    no_clock: str = ""  # why the training log's iterations mark no steps
    iterations: int = 0
    utc_offset_s: int | None = None
    outside: dict[int, int] = field(default_factory=dict)  # rank outside the world -> calls
    unpaired: int = 0  # point-to-point calls left out: their peers unknown
    vpp: int = 1

    def read_links(self, name: str, samples: list[LinkSample], bad: int) -> None:
        """A throughput log's samples read, and its rows left out."""
        self.link_samples += len(samples)
        if bad:
            self.bad_rows[name] += bad

    def took(self, reader: MegatraceLogReader) -> None:
        """What the reader inferred and left out, once it finished."""
        self.inferred, self.outside = reader.inferred, reader.outside
        self.unpaired, self.vpp = reader.unpaired, reader.cfg.vpp

    def lines_out(self) -> list[str]:
        """The report as a person reads it."""
        out = [f"config from {self.config_from}"] if self.config_from else []
        if self.training_log and self.no_clock:
            out.append(
                f"iteration clock: none from {self.training_log}: {self.no_clock}; the steps "
                "are placed by the calls' own cycle"
            )
        elif self.training_log:
            tz = self.utc_offset_s or 0
            out.append(
                f"iteration clock: {self.iterations} iterations from {self.training_log} "
                f"(its times are local: UTC{tz / 3600:+g} h)"
            )
        for what, n in sorted(self.inferred.items()):
            out.append(f"inferred: {what} ({n:,} call{'' if n == 1 else 's'})")
        for name, why in sorted(self.skipped_files.items()):
            out.append(f"skipped file {name}: {why}")
        for name, n in sorted(self.skipped_lines.items()):
            out.append(f"skipped {n:,} line{'' if n == 1 else 's'} of {name}: not call lines")
        if self.link_samples:
            out.append(f"throughput: {self.link_samples:,} samples from the NICs' logs")
        for name, n in sorted(self.bad_rows.items()):
            out.append(
                f"skipped {n:,} row{'' if n == 1 else 's'} of {name}: torn, or not numbers "
                "where the collector writes numbers"
            )
        if self.unpaired:
            out.append(
                f"skipped {self.unpaired:,} point-to-point calls: the interleaved schedule "
                f"(a virtual pipeline of {self.vpp}) orders them otherwise than 1F1B, and the "
                "logs name no peer (the pipeline's transfers are not analysed)"
            )
        for rank, n in sorted(self.outside.items()):
            out.append(
                f"skipped {n:,} call{'' if n == 1 else 's'} of rank {rank}: "
                "outside the configured world"
            )
        return out


def _why(e: Exception) -> str:
    """Why a file could not be read, without its name (said beside it)."""
    if isinstance(e, InputFileError):
        return e.why
    return getattr(e, "strerror", None) or str(e)


def sniff(path: Path) -> str:
    """What a file of a run directory holds: ``calls``, ``csv``, ``training``,
    ``config``, or why it is none of these."""
    try:  # the NICs' throughput logs are named <host>_<NIC>_Port<i>_A.log and _B.log
        with open_text(path) as f:
            head = f.readline(4096)
    except (InputFileError, *STREAM_ERRORS) as e:
        return f"unreadable ({_why(e)})"
    suffix = inner_suffix(path)
    if "FromRank" in head and "Bandwidth" in head:
        return "csv"
    if suffix == ".csv":
        return "a CSV without FromRank"
    if suffix in (".yaml", ".yml", ".json"):
        try:
            read_megatron_config(path, world_size=1)
        except (ConfigFormatError, OSError, ValueError) as e:
            return f"not a Megatron configuration ({str(e)[:80]})"
        return "config"
    calls = others = 0
    training = False
    try:
        with open_text(path) as f:
            for n, line in enumerate(f):
                if n >= _SNIFF_LINES or calls >= 20:
                    break
                if not line.strip():
                    continue
                if "arguments ---" in line or "elapsed time per iteration" in line:
                    training = True
                    break
                try:
                    parse_line(line)
                    calls += 1
                except LogFormatError:
                    others += 1
    except (InputFileError, *STREAM_ERRORS) as e:  # (compressed, cut short in its head)
        return f"unreadable ({_why(e)})"
    if training:
        return "training"
    if calls and calls >= others:
        return "calls"
    return "not a call log, a throughput CSV, a training log or a configuration"


def read_call_log(path: Path, report: RunReport) -> list[CallLine]:
    """The call lines of one file, in its order; other lines are counted in ``report``."""
    calls, other = parse_text(read_text(path))
    if other:
        report.skipped_lines[path.name] += other
    report.lines += len(calls)
    return calls


@dataclass
class RunFiles:
    calls: list[Path] = field(default_factory=list)
    csvs: list[Path] = field(default_factory=list)
    training: Path | None = None
    configs: list[Path] = field(default_factory=list)


def survey(directory: Path, report: RunReport) -> RunFiles:
    """The run directory's files by kind; the rest named in ``report``."""
    files = RunFiles()
    for path in sorted(p for p in Path(directory).iterdir() if p.is_file()):
        kind = sniff(path)
        if kind == "calls":
            files.calls.append(path)
        elif kind == "csv":
            files.csvs.append(path)
        elif kind == "training" and files.training is None:
            files.training = path
        elif kind == "config":
            files.configs.append(path)
        else:
            report.skipped_files[path.name] = (
                kind if kind != "training" else "a second training log"
            )
    return files


def _config(
    files: RunFiles, given: MegatronConfig | None, log: TrainingLog | None, world: int | None,
    report: RunReport, directory: Path,
) -> MegatronConfig:  # fmt: skip
    if given is not None:
        report.config_from = "the configuration given"
        return given
    if log is not None and log.arguments:
        assert files.training is not None
        report.config_from = f"the arguments in {files.training.name}"
        return config_from_arguments(log.arguments, str(files.training), world)
    for path in files.configs:
        report.config_from = path.name
        return read_megatron_config(path, world)
    raise LogFormatError(
        f"{directory}: no Megatron configuration: pass --config (Megatron's arguments, its "
        f"flags, or the MEGATRACE analyser's config.yaml), or keep the training log in the "
        f"directory"
    )


def import_dir(
    directory: Path,
    config: MegatronConfig | None,
    job: str,
    world_size: int | None = None,
) -> tuple[list[msgspec.Struct], RunReport]:
    """A one-shot import of a run directory (see the module docstring): every record, in
    the order a live collection would have delivered them (ranks' calls merged by time,
    layout records first), and what was read, inferred and skipped."""
    report = RunReport()
    files = survey(Path(directory), report)
    if not files.calls:
        raise LogFormatError(f"{directory}: no call logs (lines like '[<time>] [Rank N] Fun ...')")
    log = read_training_log(files.training) if files.training else None
    cfg = _config(files, config, log, world_size, report, Path(directory))
    reader = MegatraceLogReader(cfg, job)
    per_file = [read_call_log(p, report) for p in files.calls]
    report.call_logs = len(per_file)
    records = reader.feed(heapq.merge(*per_file, key=_CALL_TIME))
    records += reader.finish()
    report.took(reader)
    for csv_path in files.csvs:
        samples, bad = read_link_csv(csv_path, job, cfg)
        records += samples
        report.read_links(csv_path.name, samples, bad)
    if log is not None and log.iterations and per_file:
        last_call = max(f[-1].ts_ns for f in per_file if f)
        marks, report.utc_offset_s = iteration_marks(log, job, last_call, rank=cfg.world_size - 1)
        records += marks
        report.training_log, report.iterations = files.training.name, len(marks)  # type: ignore[union-attr]
        report.no_clock = log.no_clock() or ""
    layout = (JobInfo, RankInfo, CommInfo)
    first: list[msgspec.Struct] = []
    rest: list[msgspec.Struct] = []
    for r in records:
        (first if isinstance(r, layout) else rest).append(r)
    return sorted(first, key=_time) + sorted(rest, key=_time), report


def follow_dir(
    directory: Path,
    reader: MegatraceLogReader,
    emit: Callable[[list[msgspec.Struct]], None],
    stop: Callable[[], bool],
    poll_s: float = 0.2,
    report: RunReport | None = None,
) -> int:
    """Tail a run directory as it grows (new files too) until ``stop()``: call logs as
    calls, the training log as iteration markers, the NICs' throughput logs as link
    samples; hand the records of each poll to ``emit``; return how many call lines were
    read."""
    report = report or RunReport()
    offsets: dict[str, int] = {}
    kinds: dict[Path, str] = {}
    columns: dict[Path, tuple[str, ...]] = {}  # a throughput log's, from its header
    training = TrainingLog()
    told = 0
    last_call = 0
    while True:
        stopping = stop()  # asked before reading, so what was written before is read
        batch: list[CallLine] = []
        links: list[msgspec.Struct] = []
        for path in sorted(p for p in Path(directory).iterdir() if p.is_file()):
            if path not in kinds or kinds[path] not in ("calls", "training", "csv", "config"):
                kinds[path] = sniff(path)  # a file too new to tell may be told later
            kind = kinds[path]
            if kind not in ("calls", "training", "csv"):
                if kind != "config":
                    report.skipped_files[path.name] = kind
                continue
            report.skipped_files.pop(path.name, None)
            text = _new_text(path, offsets)
            if kind == "training":
                training.iterations += parse_training_log(text).iterations
                report.training_log = path.name
                continue
            if kind == "csv":
                found, columns[path], bad = link_samples(
                    text, reader.job, reader.cfg, columns.get(path, LINK_COLUMNS)
                )
                links += found
                report.read_links(path.name, found, bad)
                continue
            calls, other = parse_text(text)  # read as a whole file is (the same lines)
            batch += calls
            if other:
                report.skipped_lines[path.name] += other
        batch.sort(key=lambda c: c.ts_ns)
        report.lines += len(batch)
        if batch:
            last_call = max(last_call, batch[-1].ts_ns)
        out: list[msgspec.Struct] = reader.feed(batch) + sorted(links, key=_time)
        if len(training.iterations) > told and last_call:
            marks, report.utc_offset_s = iteration_marks(
                training, reader.job, last_call, rank=reader.cfg.world_size - 1
            )  # Megatron's training log is its last rank's
            report.no_clock = training.no_clock() or ""
            out += [m for m in marks if m.step > told]
            told = len(training.iterations)
        if out:
            emit(out)
        if stopping:
            tail = reader.finish()
            if tail:
                emit(tail)
            report.took(reader)
            return report.lines
        time.sleep(poll_s)


def _new_text(path: Path, offsets: dict[str, int]) -> str:
    """What was appended to ``path`` since last time (:func:`~producers.tail.new_lines`);
    a compressed file, which cannot be followed, is read whole once (a file compressed
    beside the run's logs is a finished one). A file is told compressed once, when it is
    first read, not at every poll."""
    key = str(path)
    read = offsets.get(key)
    if read == _READ_WHOLE:
        return ""
    if read is None and compression(path) is not None:
        offsets[key] = _READ_WHOLE
        return read_text(path)
    return new_lines(path, offsets).decode(errors="replace")


#: a compressed file's offset once it was read whole
_READ_WHOLE = -1


#: a call line's time (its first field), read without a Python call per line
_CALL_TIME = operator.itemgetter(0)


def _time(r: msgspec.Struct) -> int:
    return getattr(r, "enqueue_ns", None) or getattr(r, "end_ns", None) or getattr(r, "ts_ns", 0)


__all__ = ["RunReport", "follow_dir", "import_dir", "sniff", "survey"]
