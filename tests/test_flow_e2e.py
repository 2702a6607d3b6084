"""A simulated faulty job through the real broker, the Bytewax flow and embedded ClickHouse."""

from __future__ import annotations

import json
from typing import Any

import pytest
from bytewax.testing import run_main
from click.testing import CliRunner

from flows.main import build_flow
from infra.clickhouse import insert_records, read_records
from megatrace.cli import cli
from producers.sim.scenarios import build
from schemas.config import Settings
from schemas.enums import CollOp, VerdictKind
from schemas.records import Collective
from tests.helpers import flow_config, latest_verdicts, publisher

pytestmark = pytest.mark.integration


def test_story_verdicts_reach_clickhouse_with_the_injected_culprits(
    settings: Settings, ch: Any
) -> None:
    run = build("story", scale="tiny", seed=1, steps=30, kernels=False)
    pub = publisher(settings)
    pub.publish_all(run.records())
    pub.flush()
    db = settings.clickhouse.database
    insert_records(ch, db, run.labels)
    run_main(build_flow(flow_config(settings)))
    verdicts = {v.kind: v for v in read_records(ch, db, "verdicts", f"job = '{run.spec.job}'")}
    link, gpu, hang = run.labels
    assert verdicts[VerdictKind.LINK_DEGRADATION].link == link.link
    assert verdicts[VerdictKind.SLOWDOWN].rank == gpu.rank
    h = verdicts[VerdictKind.HANG]
    assert (h.rank, h.phase, h.microbatch) == (hang.rank, hang.phase, hang.microbatch)
    # the step table and the aligned collectives are there too, without duplicates
    steps = ch.query(
        f"SELECT count(), uniqExact(step) FROM {db}.steps FINAL WHERE job = '{run.spec.job}'"
    ).result_rows[0]
    assert steps[0] == steps[1] >= hang.onset_step
    missing = ch.query(
        f"SELECT count() FROM {db}.collectives FINAL WHERE job = "
        f"'{run.spec.job}' AND has(missing_ranks, {hang.rank})"
    ).result_rows[0][0]
    assert missing >= 1
    # every instance has its row: a pipeline pair's sends both ways share sequence numbers
    instances = {
        (r.comm_hash, r.seq, (r.rank if r.op is CollOp.SEND else r.peer) if r.op.is_p2p else -1)
        for r in run.records()
        if isinstance(r, Collective)
    }
    stored = ch.query(
        f"SELECT count() FROM {db}.collectives FINAL WHERE job = '{run.spec.job}'"
    ).result_rows[0][0]
    assert stored == len(instances)


def test_real_recordings_through_the_flow_name_whom_the_offline_analysis_names(
    settings: Settings, ch: Any
) -> None:
    """Two real jobs kept from `megatrace lab` (see tests/test_lab_recordings.py) through
    the broker, the flow and ClickHouse: the flow reads its topics at their own paces (the
    markers, heartbeats and metadata ahead of the calls) and batches each poll, and still
    names the killed rank (not a peer that failed after it) and the one-step straggler
    with the time it cost."""
    import dataclasses
    import gzip
    from pathlib import Path

    from schemas.codec import decode
    from schemas.results import Verdict

    data = Path(__file__).parent / "data"
    pub = publisher(settings)
    for name in ("lab_megatron_killed_rank3.jsonl.gz", "lab_megatron_transient_rank1.jsonl.gz"):
        with gzip.open(data / name) as fh:
            pub.publish_all(decode(line) for line in fh if line.strip())
    pub.flush()
    run_main(build_flow(dataclasses.replace(flow_config(settings), console=False)))
    db = settings.clickhouse.database
    latest = {v.verdict_id: v for v in read_records(ch, db, "verdicts") if isinstance(v, Verdict)}
    found = {(v.job.split("-")[2], v.kind.value, v.rank, v.onset_step) for v in latest.values()}
    # read ahead of the calls, the heartbeats alone say where rank 3 stopped: after step
    # 8's gradient sync (its peer completed it), before its first call of step 9
    (killed,) = [f for f in found if f[0] == "killed"]
    assert killed[1:3] == ("hang", 3) and killed[3] in (8, 9)
    assert ("transient", "transient_straggler", 1, 9) in found
    (t,) = [v for v in latest.values() if v.kind.value == "transient_straggler"]
    assert 0.5e9 < t.evidence["time_lost_ns"] < 0.7e9


def test_a_network_hang_is_the_link_with_heartbeats_that_follow_collectives_only(
    settings: Settings, ch: Any
) -> None:
    """NCCL's profiler plugin counts collectives in its heartbeats, not a pipeline's
    transfers. A transfer stuck on a link then shows only in its calls, which reach the
    flow's watchdog after the heartbeats do (another topic; their aligner reports them
    open once its own clock passed the timeout): the watchdog waits for them and names
    the link, not a rank that stopped behind it; where they come later still (a loaded
    host), the one incident is revised to the link once they do."""
    run = build("network-hang", scale="tiny", seed=1, steps=30, heartbeat_p2p=False)
    pub = publisher(settings)
    pub.publish_all(run.records())
    pub.flush()
    run_main(build_flow(flow_config(settings)))
    db = settings.clickhouse.database
    (label,) = run.labels
    hangs = [v for v in read_records(ch, db, "verdicts") if v.kind == VerdictKind.HANG]
    latest = {v.verdict_id: v for v in sorted(hangs, key=lambda v: v.revision)}
    assert {(v.rank, v.link) for v in latest.values()} == {(label.rank, label.link)}


def test_store_and_detect_roles_together_do_what_one_flow_does(settings: Settings, ch: Any) -> None:
    """A split deployment (store + detect processes) stores and concludes what ``all`` does;
    the detect role never reads kernels and a refused record is announced once."""
    import dataclasses

    from flows.flow_config import Role
    from infra.clickhouse import init_db
    from schemas.records import DeadLetter
    from schemas.results import Verdict
    from schemas.tables import TABLES
    from schemas.topics import Topics
    from tests.helpers import consume_all

    run = build("story", scale="tiny", seed=1, steps=30)
    topics = Topics(prefix=settings.kafka.topic_prefix)
    pub = publisher(settings)
    pub.publish_all(run.records())
    pub.publish_raw(topics.comm, b"j", b"not json")
    pub.publish_raw(topics.kernel, b"j", b'{"type":"kernel"}')
    pub.flush()
    split, whole = settings.clickhouse.database, f"{settings.clickhouse.database}_all"
    init_db(ch, whole, retention_days=0)
    base = flow_config(settings)

    def tables(db: str) -> dict[str, int]:
        return {
            t: ch.query(f"SELECT count() FROM {db}.{t} FINAL").result_rows[0][0] for t in TABLES
        }

    run_main(build_flow(dataclasses.replace(base, role=Role.DETECT, console=False)))
    detected = tables(split)
    assert detected["kernel_events"] == 0 and detected["collective_events"] == 0
    assert detected["collectives"] > 0 and detected["verdicts"] == len(run.labels)
    assert detected["dead_letters"] == 1  # the comm topic's bad record; kernels are not read
    run_main(build_flow(dataclasses.replace(base, role=Role.STORE, console=False)))
    assert len(consume_all(settings, topics.deadletter, expect=3, timeout_s=3)) == 2
    run_main(build_flow(dataclasses.replace(base, database=whole, console=False)))
    assert tables(split) == tables(whole)
    assert tables(whole)["kernel_events"] > 0 and tables(whole)["dead_letters"] == 2

    def verdicts(db: str) -> dict[str, Verdict]:
        """Each incident's latest revision. How many revisions led there depends on how
        the topics' reads interleaved (a link read before or after the steps around its
        onset), which two runs need not share; and each run's latest severity is within
        the verdict book's ``min_change`` (0.05) of the one it did not announce."""
        return {v.verdict_id: v for v in read_records(ch, db, "verdicts") if isinstance(v, Verdict)}

    def concluded(v: Verdict) -> tuple[object, ...]:
        return (v.status, v.kind, v.cause, v.rank, v.link, v.step, v.phase, v.microbatch)

    apart, together = verdicts(split), verdicts(whole)
    assert apart.keys() == together.keys()
    for vid, v in apart.items():
        assert concluded(v) == concluded(together[vid])
        assert abs(v.severity - together[vid].severity) <= 2 * 0.05
    assert {type(d) for d in read_records(ch, split, "dead_letters")} == {DeadLetter}


def test_analyze_reads_what_simulate_wrote(tmp_path) -> None:
    runner = CliRunner()
    res = runner.invoke(
        cli,
        [
            "simulate",
            "--scenario",
            "network-hang",
            "--seed",
            "3",
            "--no-kernels",
            "--steps",
            "24",
            "--to",
            str(tmp_path),
        ],
    )
    assert res.exit_code == 0, res.output
    res = runner.invoke(cli, ["analyze", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    lines = latest_verdicts(res.output)
    truth = json.loads((tmp_path / "labels.jsonl").read_text().splitlines()[0])
    (v,) = lines
    assert (v["kind"], v["cause"], v["link"]) == ("hang", "network_link", truth["link"])
    for key in (
        "rank",
        "node",
        "gpu",
        "step",
        "microbatch",
        "phase",
        "pp_stage",
        "comm_hash",
        "seq",
        "onset_ns",
        "detected_ns",
        "severity",
        "confidence",
        "evidence",
    ):
        assert key in v


def test_analyze_names_the_bad_line(tmp_path) -> None:
    bad = tmp_path / "r.jsonl"
    bad.write_text('{"type":"hb","job":"j","node":"n","rank":-2,"ts_ns":1}\n')
    res = CliRunner().invoke(cli, ["analyze", str(bad)])
    assert res.exit_code == 1
    assert "r.jsonl:1" in res.output and "rank" in res.output


def test_a_64_rank_scenario_goes_through_the_broker_and_decodes(settings: Settings) -> None:
    from collections import Counter

    from schemas.codec import decode
    from schemas.topics import Topics
    from tests.helpers import consume_all

    run = build("slow-gpu", scale="small", seed=0, steps=3, kernels=False)
    records = list(run.records())
    assert run.spec.world_size == 64
    pub = publisher(settings)
    pub.publish_all(records)
    pub.flush()
    topics = Topics(prefix=settings.kafka.topic_prefix)
    per_topic = Counter(topics.for_record(r) for r in records)
    got: Counter[str] = Counter()
    for topic in topics.inputs:
        for m in consume_all(settings, topic, expect=per_topic[topic], timeout_s=30):
            got[type(decode(m.value())).__name__] += 1
    assert got == Counter(type(r).__name__ for r in records)
