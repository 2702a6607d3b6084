"""A Megatron run's configuration and its iteration clock, from the files a run leaves.

:func:`read_megatron_config` reads the layout from any of: a JSON or YAML mapping of
Megatron's arguments (``tensor_model_parallel_size``...), a text of its command-line
flags (``--tensor-model-parallel-size 2``...), the original MEGATRACE analyser's
``config.yaml`` (``tpSize``, ``ppSize``, ``numRanks``, ``layers``, ``GBS``, ``isSP``),
or Megatron's own training log, whose ``arguments`` block lists every argument.

:func:`read_training_log` reads that log's iteration lines (``iteration 13/ 25 | ...
elapsed time per iteration (ms): 3593.0 | ...``): the job's own iteration clock. The
log's times are local, to the second, with no time zone; :func:`iteration_marks`
places them on the call logs' clock (the whole-quarter-hour offset that puts the last
iteration line nearest the last calls) and to the millisecond (each iteration ends
its elapsed time after the one before).

>>> text = '''
... ------------------------ arguments ------------------------
...   tensor_model_parallel_size ...................... 2
...   pipeline_model_parallel_size .................... 4
...   world_size ...................................... 64
... -------------------- end of arguments ---------------------
...  [2025-05-08 14:41:01] iteration        1/      25 | elapsed time per iteration (ms): 20249.8 |
...  [2025-05-08 14:41:02] iteration        2/      25 | elapsed time per iteration (ms): 1225.6 |
... '''
>>> log = parse_training_log(text)
>>> log.arguments["tensor_model_parallel_size"], [(i.step, i.elapsed_ms) for i in log.iterations]
('2', [(1, 20249.8), (2, 1225.6)])
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

from schemas.enums import DType, Schedule
from schemas.files import read_text, text_lines
from schemas.layout import Layout
from schemas.records import Iteration, JobInfo, RankInfo


class ConfigFormatError(ValueError):
    """A file that holds no usable Megatron configuration (with the file and why)."""


@dataclass(frozen=True)
class MegatronConfig:
    """The parts of a Megatron run's configuration the analysis needs."""

    world_size: int
    tp: int = 1
    pp: int = 1
    num_layers: int = 0
    global_batch_size: int = 0
    micro_batch_size: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    dtype: DType = DType.BFLOAT16
    gpus_per_node: int = 8
    #: model chunks per pipeline stage (Megatron's interleaved 1F1B where more than one)
    vpp: int = 1

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def num_microbatches(self) -> int:
        if not self.global_batch_size:
            return 1
        return max(1, self.global_batch_size // (self.micro_batch_size * self.dp))

    def job_record(self, job: str, ts_ns: int, source: str) -> JobInfo:
        """The job's layout record."""
        return JobInfo(
            job=job,
            ts_ns=ts_ns,
            source=source,
            world_size=self.world_size,
            tp=self.tp,
            pp=self.pp,
            dp=self.dp,
            num_layers=self.num_layers,
            global_batch_size=self.global_batch_size,
            micro_batch_size=self.micro_batch_size,
            num_microbatches=self.num_microbatches,
            sequence_parallel=self.sequence_parallel,
            distributed_optimizer=self.distributed_optimizer,
            gpus_per_node=self.gpus_per_node,
            vpp=self.vpp,
            schedule=Schedule.INTERLEAVED_1F1B if self.vpp > 1 else Schedule.ONE_F_ONE_B,
        )

    def rank_record(self, job: str, ts_ns: int, rank: int, node: str) -> RankInfo:
        """Where one rank runs and its Megatron coordinates (:mod:`schemas.layout`)."""
        lay = Layout(self.world_size, self.tp, self.pp, self.dp, 1, self.gpus_per_node)
        stage, d, t = lay.coords(rank)
        return RankInfo(
            job=job,
            ts_ns=ts_ns,
            rank=rank,
            node=node,
            gpu=lay.gpu(rank),
            nic=lay.nic(rank),
            tp_rank=t,
            pp_stage=stage,
            dp_rank=d,
        )


#: Each setting's names: Megatron's argument, its short forms, the MEGATRACE analyser's
_KEYS = {
    "world_size": ("world_size", "numRanks", "WORLD_SIZE"),
    "tp": ("tensor_model_parallel_size", "tp", "TP", "tpSize"),
    "pp": ("pipeline_model_parallel_size", "pp", "PP", "ppSize"),
    "num_layers": ("num_layers", "layers", "NUM_LAYERS"),
    "global_batch_size": ("global_batch_size", "gbs", "GBS"),
    "micro_batch_size": ("micro_batch_size", "mbs", "MBS"),
    "sequence_parallel": ("sequence_parallel", "isSP"),
    "distributed_optimizer": ("use_distributed_optimizer", "distributed_optimizer"),
    "gpus_per_node": ("gpus_per_node", "nproc_per_node", "GPUS_PER_NODE"),
    "vpp": ("virtual_pipeline_model_parallel_size", "vpp", "VPP"),
}
_TRUE = (True, "true", "True", 1, "1")


def config_from_arguments(
    raw: dict[str, Any], where: str, world_size: int | None = None
) -> MegatronConfig:
    """A :class:`MegatronConfig` from a mapping of arguments (any of the names above)."""
    raw = {str(k).replace("-", "_"): v for k, v in raw.items()}
    values: dict[str, Any] = {}
    for name, keys in _KEYS.items():
        for k in keys:
            if k in raw and raw[k] not in (None, "None"):
                values[name] = raw[k]
                break
    per_chunk = raw.get("num_layers_per_virtual_pipeline_stage")
    if "vpp" not in values and per_chunk not in (None, "None") and "num_layers" in values:
        try:  # the older way to ask for the interleaved schedule
            values["vpp"] = int(values["num_layers"]) // int(values.get("pp", 1)) // int(per_chunk)
        except (TypeError, ValueError, ZeroDivisionError):
            raise ConfigFormatError(
                f"{where}: num_layers_per_virtual_pipeline_stage {per_chunk!r} is not a "
                "number of layers"
            ) from None
    if "world_size" not in values:
        if world_size is None:
            raise ConfigFormatError(
                f"{where}: no world size (world_size, or numRanks), and none given"
            )
        values["world_size"] = world_size
    dtype = (
        DType.FLOAT16
        if raw.get("fp16") in _TRUE and raw.get("bf16") not in _TRUE
        else (DType.BFLOAT16)
    )
    try:
        cfg = MegatronConfig(
            **{
                k: (v in _TRUE) if k in ("sequence_parallel", "distributed_optimizer") else int(v)
                for k, v in values.items()
            },
            dtype=dtype,
        )
    except (TypeError, ValueError) as e:
        raise ConfigFormatError(f"{where}: {e}") from None
    if cfg.vpp < 1:
        raise ConfigFormatError(f"{where}: a virtual pipeline of {cfg.vpp} model chunks")
    if cfg.tp < 1 or cfg.pp < 1 or cfg.world_size < 1 or cfg.world_size % (cfg.tp * cfg.pp):
        raise ConfigFormatError(
            f"{where}: world size {cfg.world_size} is not a multiple of TP x PP = "
            f"{cfg.tp} x {cfg.pp}"
        )
    return cfg


def read_megatron_config(path: Path, world_size: int | None = None) -> MegatronConfig:
    """The configuration in ``path``: any of the forms in the module docstring."""
    text = read_text(path)
    raw: Any
    if _ARGS_START in text:
        raw = parse_training_log(text).arguments
    else:
        try:
            raw = json.loads(text)
        except ValueError:
            if "--" in text:
                raw = _flags(text)
            else:
                import yaml

                try:
                    raw = yaml.safe_load(text) or {}
                except yaml.YAMLError as e:
                    raise ConfigFormatError(f"{path}: not JSON, YAML or flags ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigFormatError(f"{path}: expected a mapping of Megatron arguments")
    return config_from_arguments(raw, str(path), world_size)


def _flags(text: str) -> dict[str, Any]:
    raw: dict[str, Any] = {}
    tokens = shlex.split(text.replace("\\\n", " "), comments=True)
    for i, tok in enumerate(tokens):
        if tok.startswith("--"):
            nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
            flag = nxt == "" or nxt.startswith("--")
            raw[tok[2:].replace("-", "_")] = True if flag else nxt
    return raw


# --------------------------------------------------------------------------- training log

_ARGS_START = "------------------------ arguments ------------------------"
_ARGS_END = "end of arguments"
_ARG = re.compile(r"^\s+(\w+) \.+ (.*?)\s*$")
#: an iteration line; older Megatron releases print no time before it
_ITER = re.compile(
    r"(?:\[(?P<when>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\]\s+)?iteration\s+(?P<step>\d+)\s*/\s*\d+\s*\|"
    r".*?elapsed time per iteration \(ms\): (?P<ms>[\d.]+)"
)


@dataclass(frozen=True)
class LoggedIteration:
    step: int
    local: datetime | None  # as printed: local time, to the second (None: none printed)
    elapsed_ms: float  # the mean over the iterations since the line before


@dataclass
class TrainingLog:
    """What a Megatron training log says: its arguments and its iterations."""

    arguments: dict[str, str] = field(default_factory=dict)
    iterations: list[LoggedIteration] = field(default_factory=list)

    @property
    def is_training_log(self) -> bool:
        return bool(self.arguments or self.iterations)

    def no_clock(self) -> str | None:
        """Why its iteration lines cannot mark the job's steps (None: they can). They can
        where each iteration has its line, one after another, with its time: Megatron
        prints one every ``log_interval`` iterations (100 unless told), with their mean
        time, and a restarted job's log goes back to its checkpoint's iteration."""
        if any(i.local is None for i in self.iterations):
            return "its iteration lines carry no time (an older Megatron)"
        gaps = {b.step - a.step for a, b in pairwise(self.iterations)} - {1}
        if not gaps:
            return None
        if len(gaps) == 1 and (gap := gaps.pop()) > 1:
            return f"it has a line every {gap} iterations (log_interval {gap}), not one each"
        return "its iterations do not follow one another (a restart from a checkpoint?)"


def parse_training_log(text: str | Iterable[str]) -> TrainingLog:
    """The arguments block and iteration lines of a Megatron training log."""
    log = TrainingLog()
    lines = text.splitlines() if isinstance(text, str) else text
    inside = False
    for line in lines:
        if _ARGS_START in line:
            inside = True
            continue
        if inside:
            if _ARGS_END in line:
                inside = False
            elif m := _ARG.match(line):
                log.arguments[m[1]] = m[2]
            continue
        if "iteration" in line and (m := _ITER.search(line)):
            local = datetime.strptime(m["when"], "%Y-%m-%d %H:%M:%S") if m["when"] else None
            log.iterations.append(LoggedIteration(int(m["step"]), local, float(m["ms"])))
    return log


def read_training_log(path: Path) -> TrainingLog:
    return parse_training_log(text_lines(path))


def iteration_marks(
    log: TrainingLog, job: str, calls_end_ns: int, rank: int = 0
) -> tuple[list[Iteration], int]:
    """The log's iterations as :class:`Iteration` markers on the call logs' clock, and the
    time-zone offset found (seconds east of UTC).

    ``calls_end_ns`` is the last call the logs hold (it is near the last iteration's
    end). The printed second of each iteration is its true end truncated, so the ends
    ``e_k = e_0 + sum(elapsed)`` are placed by the tightest constant ``e_0`` that keeps
    every ``e_k`` at or after its printed second. No markers where its lines cannot mark
    the steps (:meth:`TrainingLog.no_clock` says why)."""
    its = sorted(log.iterations, key=lambda i: i.step)
    if not its or log.no_clock() is not None:
        return [], 0
    naive = [i.local.replace(tzinfo=UTC).timestamp() for i in its if i.local is not None]
    offset = round((naive[-1] - calls_end_ns / 1e9) / 900) * 900  # whole quarter hours
    printed = [t - offset for t in naive]
    run, ends = 0.0, []
    for i in its:
        run += i.elapsed_ms / 1e3
        ends.append(run)
    base = max(p - e for p, e in zip(printed, ends, strict=True))
    marks = [
        Iteration(
            job=job,
            step=i.step,
            end_ns=int((base + e) * 1e9),
            duration_ns=int(i.elapsed_ms * 1e6),
            rank=rank,
            source="megatron-log",
        )
        for i, e in zip(its, ends, strict=True)
    ]
    return marks, offset


__all__ = [
    "ConfigFormatError",
    "LoggedIteration",
    "MegatronConfig",
    "TrainingLog",
    "config_from_arguments",
    "iteration_marks",
    "parse_training_log",
    "read_megatron_config",
    "read_training_log",
]
