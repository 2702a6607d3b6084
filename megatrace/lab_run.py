"""Running the lab's cases through the real components, and its table (see
:mod:`megatrace.lab`)."""

from __future__ import annotations

import shutil
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from infra.netlab import LabError, NetLab, missing
from megatrace.lab import CaseRun, Ranks, inject
from megatrace.lab_cases import CASES, too_few_steps
from megatrace.lab_labels import labels_of, step_ns
from schemas.config import AgentSettings, Settings
from schemas.records import Iteration, event_time
from schemas.results import Verdict

#: the raw tables a case's recording is read back from
_RAW = (
    "jobs",
    "ranks",
    "comms",
    "collective_events",
    "proxy_events",
    "heartbeats",
    "iterations",
    "link_samples",
)


def run_lab(
    settings: Settings, names: list[str], out_dir: Path, say: Any, steps: int | None = None
) -> list[CaseRun]:
    """Every named case, in order (each for ``steps`` training steps where given: a long
    healthy soak measures false alarms over the job's real noise); the lab's namespaces,
    links, qdiscs and cgroups are removed on the way out, also after a failure or
    Ctrl-C."""
    from infra.stack import Stack

    if why := too_few_steps(steps):
        raise LabError(why)
    why = missing()
    if why:
        raise LabError(why)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise LabError(f"no lab case {', '.join(unknown)} (cases: {', '.join(CASES)})")
    stack = Stack(settings)
    _, started = stack.up()
    lab = NetLab(Path(settings.stack.state_dir) / "lab", max(CASES[n].nodes for n in names))
    runs: list[CaseRun] = []
    try:
        lab.up()
        for i, name in enumerate(names):
            case = CASES[name] if steps is None else replace(CASES[name], steps=steps)
            say(
                f"[{i + 1}/{len(names)}] {name}: {case.workload}, {case.ranks} ranks on "
                f"{case.nodes} nodes, {case.steps} steps"
            )
            run = run_case(case, settings, stack, lab, out_dir / name, 29700 + i % 50)
            runs.append(run)
            say(f"      {_told(run)}")
            save(run, out_dir / name)
    finally:
        lab.down()
        if started:
            stack.down()
    return runs


def run_case(
    case: Any, settings: Settings, stack: Any, lab: NetLab, run_dir: Path, port: int
) -> CaseRun:
    from bytewax.testing import run_main

    from flows.flow_config import flow_config
    from flows.main import build_flow
    from infra.kafka import ensure_topics, producer_config
    from producers.agent import NodeAgent
    from schemas.topics import Topics

    t0 = time.monotonic()
    if run_dir.exists():  # an earlier run's files (its progress above all) must not count
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    job = f"lab-{case.name}-{time.strftime('%H%M%S')}"
    run = CaseRun(case, job)
    boot = stack.bootstrap()
    topics = Topics(prefix=f"lab{time.time_ns() % 10**9}.")
    ensure_topics(settings.kafka, boot, topics)
    agents, sockets = [], {}
    for node in lab.nodes[: case.nodes]:
        d = run_dir / f"agent-{node.name}"
        sockets[node.index] = d / "agent.sock"
        cfg = AgentSettings(
            job=job,
            node=node.name,
            socket=str(sockets[node.index]),
            spool_dir=str(d / "spool"),
            health_file=str(d / "health.json"),
        )
        agents.append(NodeAgent(cfg, producer_config(settings.kafka, boot), topics, d))
    for a in agents:
        a.start()
    stopping, stopped = threading.Lock(), threading.Event()

    def stop_agents(drain_s: float) -> None:
        with stopping:
            if not stopped.is_set():
                for a in agents:
                    a.stop(drain_s=drain_s)
                stopped.set()  # everything the job said is delivered

    ranks = Ranks(case, lab.nodes[: case.nodes], job, run_dir, port, sockets)
    try:
        if not ranks.wait_step(0, timeout_s=240):  # the flow starts once the job does
            run.error = "the job did not start (see its ranks' logs in " + str(run_dir) + ")"
            ranks.kill()
            return run

        def drive() -> None:
            try:
                inject(lab, ranks, case, run.injected)
            finally:
                stop_agents(15)

        driver = threading.Thread(target=drive, name="megatrace-lab", daemon=True)
        driver.start()
        flow = flow_config(
            settings,
            boot,
            stack.clickhouse_url(),
            topics=topics,
            tail=False,
            idle_stop_s=2.0,
            console=False,
            retention_days=0,
            input_complete=stopped.is_set,  # the job ended and its agents delivered all
        )
        run_main(build_flow(flow))
        driver.join()
    finally:
        ranks.kill()
        stop_agents(2)
    _results(run, stack, settings, lab)
    _flight_recorders(run, run_dir / "fr")
    run.seconds = time.monotonic() - t0
    return run


def _results(run: CaseRun, stack: Any, settings: Settings, lab: NetLab) -> None:
    from infra.clickhouse import read_records

    ch, db = stack.clickhouse(), settings.clickhouse.database
    where, params = "job = {j:String}", {"j": run.job}
    run.verdicts = list(read_records(ch, db, "verdicts", where, params))
    run.records = [r for t in _RAW for r in read_records(ch, db, t, where, params)]
    run.records.sort(key=event_time)
    run.marks = [r for r in run.records if isinstance(r, Iteration)]
    run.labels = labels_of(run, lab.nodes)


def _flight_recorders(run: CaseRun, fr_dir: Path) -> None:
    """megatrace's verdicts from the ranks' Flight Recorder dumps alone, as an SRE would
    import them after a hang, telling the job's size (``megatrace import flight-recorder
    --world-size``: a killed rank writes no dump, and Gloo's dumps name no group's
    members where its groups have no names)."""
    from detectors.replay import Replay
    from producers.flight_recorder import DumpFormatError, import_dumps
    from producers.megatron_config import MegatronConfig

    dumps = sorted(fr_dir.glob("rank_*"), key=lambda p: int(p.name.split("_")[1]))
    run.fr_ranks = [int(p.name.split("_")[1]) for p in dumps]
    if not dumps:
        return
    try:
        records, _ = import_dumps(dumps, run.job, MegatronConfig(world_size=run.case.ranks))
    except DumpFormatError as e:
        run.error = f"its Flight Recorder dumps could not be read: {e}"
        return
    run.fr_verdicts = [v for v in Replay().run(records) if isinstance(v, Verdict)]


def save(run: CaseRun, d: Path) -> None:
    """The case as a labelled recording (``megatrace eval --corpus``)."""
    from schemas.codec import write_jsonl

    d.mkdir(parents=True, exist_ok=True)
    write_jsonl(d / "records.jsonl", run.records)
    write_jsonl(d / "labels.jsonl", run.labels)
    write_jsonl(d / "verdicts.jsonl", run.verdicts)


def _told(run: CaseRun) -> str:
    if run.error:
        return f"error: {run.error}"
    from detectors import texts

    found = "; ".join(f"{texts.kind(v)} of {texts.culprit(v)}" for v in run.verdicts) or "none"
    truth = (
        "; ".join(
            f"{lab.kind.value.replace('_', ' ')} of "
            f"{f'rank {lab.rank}' if lab.rank is not None else lab.node}"
            for lab in run.labels
        )
        or "healthy"
    )
    steps = len(run.marks)
    fr = ""
    if run.fr_ranks:
        from_fr = "; ".join(f"{texts.kind(v)} of {texts.culprit(v)}" for v in run.fr_verdicts)
        fr = f"; from {len(run.fr_ranks)} Flight Recorder dumps: {from_fr or 'none'}"
    return (
        f"{run.seconds:.0f} s, {steps} steps ({step_ns(run.marks) / 1e6:.0f} ms each); "
        f"injected: {truth}; found: {found}{fr}"
    )


def table(runs: list[CaseRun], baselines: bool = True) -> list[str]:
    """The quality table, as ``megatrace eval`` prints it, megatrace beside its peers."""
    from detectors.baselines import BASELINES
    from detectors.scoring import Score

    methods = ["megatrace", *(BASELINES if baselines else [])]
    scores = {m: Score() for m in methods}
    for run in runs:
        if run.error:
            continue
        per_step = step_ns(run.marks)
        steps = len(run.marks)
        scores["megatrace"].add_run(run.labels, run.verdicts, steps, per_step)
        for m in methods[1:]:
            found: list[Verdict] = BASELINES[m]().run(run.records)
            scores[m].add_run(run.labels, found, steps, per_step)
    lines = []
    for m in methods:
        lines += ["", f"== {m} ({sum(not r.error for r in runs)} lab runs)", *scores[m].table()]
    dumped = [r for r in runs if r.fr_ranks and not r.error]
    if dumped:  # what the ranks' own Flight Recorder dumps tell, read by megatrace
        fr = Score()
        for run in dumped:
            fr.add_run(run.labels, run.fr_verdicts, len(run.marks), step_ns(run.marks))
        lines += ["", f"== megatrace on the ranks' Flight Recorder dumps ({len(dumped)} hung "
                  "runs, dumped at the lab's hang timeout)", *fr.table()]  # fmt: skip
    return lines


__all__ = ["run_case", "run_lab", "save", "table"]
