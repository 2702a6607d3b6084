"""How verdicts read: pure functions that turn a verdict's fields into words.

Unknown fields are left out rather than printed as ``None``, and counts agree with
their nouns.

>>> plural(1, "rank"), plural(3, "rank"), plural(2, "micro-batch")
('1 rank', '3 ranks', '2 micro-batches')
>>> where(step=32, phase="forward", microbatch=3, pp_stage=1)
'forward micro-batch 3, PP stage 1, step 32'
>>> where(step=None, phase="dp_sync", microbatch=None, pp_stage=None)
'gradient sync'
>>> who(rank=15, gpu=3, node="node-3")
'rank 15 (GPU 3) on node-3'
>>> who(rank=None, gpu=None, node="node-3")
'node-3'
>>> percent(0.153), percent(0.004), percent(1.0)
('15%', '0.4%', '100%')
"""

from __future__ import annotations

from schemas.enums import Cause, VerdictKind
from schemas.results import Verdict

_PLURALS = {"micro-batch": "micro-batches", "is": "are", "waits": "wait"}
_PHASES = {
    "forward": "forward",
    "backward": "backward",
    "dp_sync": "gradient sync",
    "optimizer": "optimizer",
    "transfer": "transfer",
}


def plural(n: int, noun: str) -> str:
    """``n`` and ``noun``, the noun in the plural unless ``n`` is 1."""
    return f"{n:,} {noun if n == 1 else _PLURALS.get(noun, noun + 's')}"


def percent(x: float) -> str:
    """A fraction as a person writes it: whole percents, a decimal below 1%."""
    p = 100 * x
    return f"{p:.1f}%" if 0 < p < 1 else f"{p:.0f}%"


def where(
    step: int | None = None,
    phase: str | None = None,
    microbatch: int | None = None,
    pp_stage: int | None = None,
) -> str:
    """The position in the schedule, with only what is known ('' when nothing is)."""
    parts = []
    name = _PHASES.get(phase or "", "")
    if name and microbatch is not None:
        parts.append(f"{name} micro-batch {microbatch}")
    elif name:
        parts.append(name)
    elif microbatch is not None:
        parts.append(f"micro-batch {microbatch}")
    if pp_stage is not None:
        parts.append(f"PP stage {pp_stage}")
    if step is not None:
        parts.append(f"step {step}")
    return ", ".join(parts)


def cpu_wait(evidence: dict[str, float]) -> str:
    """How long a CPU-starved culprit's threads waited for a CPU ('' if not measured).

    >>> cpu_wait({"cpu_wait_share": 1.84, "usual_cpu_wait_share": 0.21})
    'waiting for a CPU 1.84 s a second (the job usually 0.21)'
    >>> cpu_wait({"cpu_wait_share": 0.12, "usual_cpu_wait_share": 0.05,
    ...           "cpu_throttled_share": 0.21, "usual_cpu_throttled_share": 0.0})
    'throttled by its CPU quota 0.21 s a second (the job usually 0.00)'
    """
    held = evidence.get("cpu_throttled_share")
    if held is not None:  # the kernel's throttled time counts each CPU the quota held back
        usual = evidence.get("usual_cpu_throttled_share", 0.0)
        return f"throttled by its CPU quota {held:.2f} s a second (the job usually {usual:.2f})"
    share = evidence.get("cpu_wait_share")
    if share is None:
        return ""
    usual = evidence.get("usual_cpu_wait_share", 0.0)
    return f"waiting for a CPU {share:.2f} s a second (the job usually {usual:.2f})"


def listed(items: list[object]) -> str:
    """Items in words.

    >>> listed([2]), listed([2, 3]), listed(["a", "b", "c"])
    ('2', '2 and 3', 'a, b and c')
    """
    words = [str(x) for x in items]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


def who(rank: int | None, gpu: int | None, node: str | None) -> str:
    """A rank with its GPU and node, or the node alone ('' when neither is known)."""
    if rank is None:
        return node or ""
    gpu_text = f" (GPU {gpu})" if gpu is not None else ""
    return f"rank {rank}{gpu_text}" + (f" on {node}" if node else "")


def culprit(v: Verdict) -> str:
    """Who or what a verdict blames, in a few words."""
    ranks = list(getattr(v, "culprit_ranks", None) or [])
    if len(ranks) > 1:
        return "ranks " + listed(ranks)
    if v.cause in (Cause.NETWORK_LINK, Cause.NIC) and v.link:
        return v.link
    if v.rank is not None:
        return who(v.rank, v.gpu, v.node)
    if v.node:
        return f"host {v.node}"
    if v.link:
        return v.link
    return "unlocalised"


def kind(v: Verdict) -> str:
    """The verdict's kind in words ('link degradation')."""
    return v.kind.value.replace("_", " ")


def cause(v: Verdict) -> str:
    """The cause in words ('network link'; '' when unknown)."""
    return "" if v.cause is Cause.UNKNOWN else v.cause.value.replace("_", " ")


def cost(v: Verdict) -> str:
    """What the incident costs, as a share of throughput ('' for nothing measured)."""
    if v.kind is VerdictKind.HANG:
        return "all"
    return percent(v.severity) if v.severity > 0 else ""


def network(link: str) -> str:
    """The network between nodes (``"a<->b"``), or one node's links (``"a"``), in words.

    >>> network("node-1<->node-2"), network("node-1")
    ('the network between node-1 and node-2', 'the network links of node-1')
    """
    nodes = link.split("<->")
    if len(nodes) == 1:
        return f"the network links of {nodes[0]}"
    return f"the network between {', '.join(nodes[:-1])} and {nodes[-1]}"


def slowdown_summary(
    *, kind: VerdictKind, who: str, ratio: float, onset: int, severity: float, cause: Cause,
    where: str
) -> str:  # fmt: skip
    """A step-time shift's sentence: who, how much slower since when, what it costs.

    >>> s = slowdown_summary(kind=VerdictKind.SLOWDOWN, who="rank 5 (GPU 1) on node-1",
    ...                      ratio=1.31, onset=40, severity=0.237, cause=Cause.COMPUTE,
    ...                      where="backward micro-batch 2, PP stage 1")
    >>> for part in s.replace(" - ", ", ").split(", "):
    ...     print(part)
    slowdown: rank 5 (GPU 1) on node-1
    iteration 1.31x slower since step 40 (24% throughput lost to it)
    cause compute
    backward micro-batch 2
    PP stage 1
    """
    return (
        f"{kind.value.replace('_', ' ')}: {who} - iteration {ratio:.2f}x slower since step "
        f"{onset} ({percent(severity)} throughput lost to it), cause "
        f"{cause.value.replace('_', ' ')}{f', {where}' if where else ''}"
    )


def intermittent_summary(
    *, who: str, bursts: int, mean_ratio: float, first: int, severity: float
) -> str:
    """Repeated bursts of one culprit.

    >>> intermittent_summary(who="rank 3", bursts=3, mean_ratio=1.8, first=12, severity=0.18)
    'intermittent slowdown: rank 3 - 3 bursts of ~1.80x since step 12 (18% throughput lost)'
    """
    return (
        f"intermittent slowdown: {who or 'an unlocalised part of the job'} - "
        f"{plural(bursts, 'burst')} of ~{mean_ratio:.2f}x since step {first} "
        f"({percent(severity)} throughput lost)"
    )


def transient_summary(*, who: str, onset: int, length: int, ratio: float, lost_ns: float) -> str:
    """A straggler over already: its steps and the time they lost.

    >>> transient_summary(who="rank 4", onset=13, length=1, ratio=3.02, lost_ns=2.36e9)
    'transient straggler: rank 4 - step 13 3.02x slower, 2.36 s lost'
    """
    steps = f"step {onset}" if length == 1 else f"steps {onset}-{onset + length - 1}"
    return (
        f"transient straggler: {who or 'an unlocalised part of the job'} - {steps} "
        f"{ratio:.2f}x slower, {lost_ns / 1e9:.2f} s lost"
    )


def link_summary(*, link: str, current_gbps: float, drop: float, baseline_gbps: float) -> str:
    """One link below its baseline.

    >>> link_summary(link="node-0/mlx5_1->node-1/mlx5_1", current_gbps=42.0, drop=0.58,
    ...              baseline_gbps=100.0)
    'link degradation: node-0/mlx5_1->node-1/mlx5_1 at 42 Gb/s, 58% below its 100 Gb/s baseline'
    """
    return (
        f"link degradation: {link} at {current_gbps:.0f} Gb/s, "
        f"{drop:.0%} below its {baseline_gbps:.0f} Gb/s baseline"
    )


def network_summary(*, link: str, ratio: float, onset: int, comms: int) -> str:
    """The network between nodes, from its communicators' transfer times.

    >>> for part in network_summary(link="node-0<->node-1", ratio=3.04, onset=12,
    ...                             comms=4).split(" - "):
    ...     print(part)
    link degradation: the network between node-0 and node-1
    4 communicators across it transfer 3.04x slower since step 12
    """
    return (
        f"link degradation: {network(link)} - {plural(comms, 'communicator')} across it "
        f"transfer {ratio:.2f}x slower since step {onset}"
    )


def nic_summary(*, nic: str, dsts: list[int], current_gbps: float, drop: float) -> str:
    """Several links leaving one NIC below their baselines: that NIC.

    >>> for part in nic_summary(nic="node-0/mlx5_1", dsts=[4, 8], current_gbps=40.0,
    ...                         drop=0.6).split(" - "):
    ...     print(part)
    NIC degradation: node-0/mlx5_1
    2 links from it below their baselines (towards ranks 4, 8; latest 40 Gb/s, 60% down)
    """
    return (
        f"NIC degradation: {nic} - {len(dsts)} links from it below their baselines "
        f"(towards ranks {', '.join(map(str, dsts))}; latest {current_gbps:.0f} Gb/s, "
        f"{drop:.0%} down)"
    )


__all__ = [
    "cause",
    "cost",
    "culprit",
    "hang_summary",
    "intermittent_summary",
    "kind",
    "link_summary",
    "network",
    "nic_summary",
    "percent",
    "plural",
    "slowdown_summary",
    "still_saving",
    "transient_summary",
    "where",
    "who",
]


def still_saving(for_ns: float) -> str:
    """What a hang's summary adds for a culprit saving a checkpoint all along."""
    return f"; it has been saving a checkpoint for {for_ns / 1e9:,.0f} s"


def hang_summary(
    *,
    cause: Cause,
    call: str,
    role: str,
    seq: int,
    where: str,
    rank: int | None = None,
    gpu: int | None = None,
    node: str | None = None,
    several: tuple[list[int], list[str]] = ([], []),
    waiting: int = 0,
    link: str | None = None,
    producing: bool = False,
    ended: str = "",
) -> str:
    """A hang verdict's sentence: who never joined which call (``several``: the ranks and
    their nodes, where more than one did), or the GPU that stopped in the middle of a
    transfer on ``link``, or the transfer the network never completed; ``ended``: what
    ended in it (the recording, the job's processes).

    >>> s = hang_summary(cause=Cause.COMPUTE, call="Recv", role="pp", seq=259, rank=5, gpu=1,
    ...                  node="node-1", waiting=1, where="forward micro-batch 3, PP stage 1")
    >>> for part in s.split(" - "):
    ...     print(part)
    hang: rank 5 on node-1 (GPU 1) never joined Recv on the pp communicator (seq 259)
    forward micro-batch 3, PP stage 1; 1 rank of that call waits on it
    >>> s = hang_summary(cause=Cause.NETWORK_LINK, call="Send", role="pp", seq=4,
    ...                  where="an unknown position", ended="the recording ended there")
    >>> for part in s.split(" - "):
    ...     print(part)
    hang: Send on the pp communicator (seq 4) was posted and never completed on the network
    an unknown position (the recording ended there)
    """
    ranks, nodes = several
    waits = "waits" if waiting == 1 else "wait"
    if cause == Cause.COMPUTE and link is not None:
        state = "SendGPUWait" if producing else "RecvGPUWait"
        text = (
            f"hang: the GPU of rank {rank} on {node} (GPU {gpu}) stopped "
            f"{'producing' if producing else 'consuming'} data in the middle of {call} on "
            f"{link} ({role} communicator, seq {seq}): the transfer is posted and its proxy "
            f"waits on the GPU ({state}), not the network - {where}"
        )
    elif cause == Cause.COMPUTE and len(ranks) > 1:
        text = (
            f"hang: ranks {listed(list(ranks))} on {listed(list(nodes))} never joined {call} on "
            f"the {role} communicator (seq {seq}) - {where}; {plural(waiting, 'rank')} of that "
            f"call {waits} on them"
        )
    elif cause == Cause.COMPUTE:
        text = (
            f"hang: rank {rank} on {node} (GPU {gpu}) never joined {call} on the {role} "
            f"communicator (seq {seq}) - {where}; {plural(waiting, 'rank')} of that call "
            f"{waits} on it"
        )
    else:
        text = (
            f"hang: {call} on the {role} communicator (seq {seq}) was posted and never "
            f"completed on {link or 'the network'} - {where}"
        )
    return text + (f" ({ended})" if ended else "")
