"""Files as they are found: compressed copies of call logs, training logs, dumps, traces
and recordings are read as the files themselves; a copy cut short, or in a compression
only another tool unpacks, is a clear error naming the file (never a crash); a kept
recording's folder is analysed as its records file is."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import shutil
import tarfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from megatrace.cli import cli
from producers.flight_recorder import import_dumps
from producers.kineto import TraceError, read_kineto
from producers.megatrace_run import import_dir
from schemas.codec import encode, read_jsonl
from schemas.files import InputFileError, read_bytes
from schemas.records import Collective, Kernel
from tests.call_logs import slow_run_records, write_logs
from tests.helpers import latest_verdicts
from tests.recordings import LAB41

DATA = Path(__file__).parent / "data"
PACK = {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress}


def _pack(path: Path, suffix: str) -> Path:
    """``path`` replaced by its compressed copy ``path + suffix``."""
    out = path.with_name(path.name + suffix)
    out.write_bytes(PACK[suffix](path.read_bytes()))
    path.unlink()
    return out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of the original tool's collector (call logs, the NICs' throughput CSVs) with
    the Megatron arguments beside it."""
    run, records = slow_run_records()
    d = tmp_path_factory.mktemp("runs") / "TP2PP2DP2"
    config = write_logs(run, records, d, ids=True, save_count=False)
    (d / "config.json").write_text(config.read_text())
    return d


@pytest.mark.parametrize("suffix", [".gz", ".bz2", ".xz"])
def test_a_compressed_copy_of_a_run_reads_as_the_run(
    run_dir: Path, tmp_path: Path, suffix: str
) -> None:
    """Every file of the run compressed (as it is copied off a cluster): the same records,
    and the same verdict, as from the files themselves."""
    plain, _ = import_dir(run_dir, None, "run")
    packed = tmp_path / run_dir.name
    packed.mkdir()
    for f in run_dir.iterdir():
        (packed / f.name).write_bytes(f.read_bytes())
        _pack(packed / f.name, suffix)
    got, report = import_dir(packed, None, "run")
    assert not report.skipped_files and report.config_from == f"config.json{suffix}"
    assert [encode(r) for r in got] == [encode(r) for r in plain]
    assert sum(isinstance(r, Collective) for r in got) > 1000
    res = CliRunner().invoke(cli, ["analyze", str(packed), "--json"])
    assert res.exit_code == 0, res.output
    run, _ = slow_run_records()
    assert [(v["kind"], v["rank"]) for v in latest_verdicts(res.stdout)] == [
        ("slowdown", run.labels[0].rank)
    ]


def test_a_call_log_cut_short_is_named_not_a_crash(run_dir: Path, tmp_path: Path) -> None:
    """A compressed log whose copy was interrupted: the import stops with the file named
    and why (a rank whose calls end early would read as a rank that stopped)."""
    d = tmp_path / run_dir.name
    d.mkdir()
    for f in run_dir.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    cut = _pack(d / "rank_3.log", ".gz")
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    for args in (["analyze", str(d)], ["import", "megatrace-logs", str(d), "--job", "j",
                                       "--to", str(tmp_path / "out.jsonl")]):  # fmt: skip
        res = CliRunner().invoke(cli, args)
        assert res.exit_code == 1 and not isinstance(res.exception, EOFError), res.output
        assert "rank_3.log.gz: a gzip file cut short or damaged" in res.output


def test_a_compression_only_another_tool_reads_says_which(tmp_path: Path) -> None:
    zst = tmp_path / "rank_0.log.zst"
    zst.write_bytes(b"\x28\xb5\x2f\xfd" + bytes(32))
    with pytest.raises(InputFileError, match=r"a zstd file: unpack it first \(zstd -d "):
        read_bytes(zst)


def test_a_kept_recording_s_folder_is_analysed_as_its_records(tmp_path: Path) -> None:
    """``megatrace analyze CASE`` on a folder the lab kept (records.jsonl.gz beside its
    labels), not taken for a run of call logs; a recording kept as bzip2 too."""
    case = LAB41 / "run1" / "ddp-hang"
    label = next(iter(read_jsonl(case / "labels.jsonl")))
    copy = tmp_path / "ddp-hang"
    copy.mkdir()
    (copy / "records.jsonl.bz2").write_bytes(
        bz2.compress(gzip.decompress((case / "records.jsonl.gz").read_bytes()))
    )
    for folder in (case, copy):
        res = CliRunner().invoke(cli, ["analyze", str(folder), "--json"])
        assert res.exit_code == 0, res.output
        found = [(v["kind"], v["rank"]) for v in latest_verdicts(res.stdout)]
        assert found == [("hang", label.rank)]


def test_compressed_flight_recorder_dumps_read_as_the_dumps(tmp_path: Path) -> None:
    """Real dumps (Gloo, a Megatron job whose rank 3 was killed), each kept xz-compressed
    under its own name: the records the dumps give."""
    with tarfile.open(DATA / "fr_gloo_megatron_rank3_killed.tar.gz") as tar:
        tar.extractall(tmp_path / "plain", filter="data")
    dumps = sorted((tmp_path / "plain" / "fr").glob("rank_*"))
    packed = tmp_path / "packed"
    packed.mkdir()
    for p in dumps:  # compressed as xz does it, keeping the file's time (a dump's own)
        (packed / p.name).write_bytes(lzma.compress(p.read_bytes()))
        shutil.copystat(p, packed / p.name)
    plain, skipped = import_dumps(dumps, "j")
    got, _ = import_dumps(sorted(packed.iterdir()), "j")
    assert [encode(r) for r in got] == [encode(r) for r in plain]
    assert len(dumps) >= 3 and skipped == {} and plain


def test_a_kineto_trace_without_distributed_info_takes_its_rank_from_its_name(
    tmp_path: Path,
) -> None:
    """A trace of a process that told no ``distributedInfo`` (a job that set up no process
    group, an AMD trace): its rank from a name such as Holistic Trace Analysis gives its
    traces; with neither, an error that says how to name it."""
    doc = {
        "baseTimeNanoseconds": 1_700_000_000_000_000_000,
        "traceEvents": [
            {
                "ph": "X",
                "cat": "kernel",
                "name": "gemm",
                "ts": 10.0,
                "dur": 5.0,
                "args": {"device": 0, "stream": 7, "correlation": 1},
            }
        ],
    }
    named = tmp_path / "sampled_rank-5.json.gz"
    named.write_bytes(gzip.compress(json.dumps(doc).encode()))
    (k,) = [r for r in read_kineto(named, job="j", node="n") if isinstance(r, Kernel)]
    assert k.rank == 5 and k.start_ns == doc["baseTimeNanoseconds"] + 10_000
    unnamed = tmp_path / "trace.json"
    unnamed.write_text(json.dumps(doc))
    with pytest.raises(TraceError, match="no rank in its name"):
        list(read_kineto(unnamed, job="j", node="n"))


@pytest.mark.parametrize("mode", ["w:xz", "w"])
def test_a_run_shipped_as_a_tar_archive_is_analysed_as_its_folder(
    run_dir: Path, tmp_path: Path, mode: str
) -> None:
    """``megatrace analyze run.tar.xz``: the run's folder unpacked (its name the job's),
    the verdict its folder gives; an archive cut short is named, not a crash."""
    archive = tmp_path / ("run.tar.xz" if mode == "w:xz" else "run.tar")
    with tarfile.open(archive, mode) as t:
        t.add(run_dir, arcname=run_dir.name)
    found = []
    for target in (run_dir, archive):
        res = CliRunner().invoke(cli, ["analyze", str(target), "--json"])
        assert res.exit_code == 0, res.output
        found.append([(v["kind"], v["rank"]) for v in latest_verdicts(res.stdout)])
    assert found[0] == found[1] and found[0][0][0] == "slowdown"
    cut = tmp_path / "cut.tar"
    cut.write_bytes(archive.read_bytes()[: archive.stat().st_size * 2 // 3])
    res = CliRunner().invoke(cli, ["analyze", str(cut)])
    assert res.exit_code == 1 and str(cut) in res.output, res.output
