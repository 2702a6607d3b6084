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
from schemas.records import Verdict

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


__all__ = ["cause", "cost", "culprit", "kind", "percent", "plural", "where", "who"]


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
    ended: bool = False,
) -> str:
    """A hang verdict's sentence: who never joined which call (``several``: the ranks and
    their nodes, where more than one did), or the GPU that stopped in the middle of a
    transfer on ``link``, or the transfer the network never completed.

    >>> s = hang_summary(cause=Cause.COMPUTE, call="Recv", role="pp", seq=259, rank=5, gpu=1,
    ...                  node="node-1", waiting=1, where="forward micro-batch 3, PP stage 1")
    >>> for part in s.split(" - "):
    ...     print(part)
    hang: rank 5 on node-1 (GPU 1) never joined Recv on the pp communicator (seq 259)
    forward micro-batch 3, PP stage 1; 1 rank of that call waits on it
    >>> s = hang_summary(cause=Cause.NETWORK_LINK, call="Send", role="pp", seq=4,
    ...                  where="an unknown position", ended=True)
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
    return text + (" (the recording ended there)" if ended else "")
