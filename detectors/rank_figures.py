"""A step's per-rank figures, from its parts' folded instances (see
:mod:`detectors.parts`): lateness in TP collectives (the cross-rank wait-time model),
exclusive blame of the last arriver, the host's lead over the GPU, waits, first arrival
and last end, computed as arrays (a part folds hundreds of instances a step).
"""

from __future__ import annotations

import itertools
from operator import attrgetter, itemgetter
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from detectors.parts import StepPart

NEVER = 1 << 62
#: the per-rank sums a part carries, in the rows of :attr:`StepPart.sealed`
SUMS = ("lead_sum", "lead_n", "wait", "lateness", "blame", "blame_any")
#: what a folded instance adds besides arrivals, host lead and its members' wait for the
#: last to arrive (a pipeline stage waiting for its input waits too): the TP wait-time
#: model (lateness, blame), the last arriver's blame in any collective (who makes the
#: others wait, in any layout)
WAIT_MODEL, ANY = 2, 4
_NEVER, _SUMS, _WAIT_MODEL, _ANY = NEVER, SUMS, WAIT_MODEL, ANY  # short names


def dense_ranks(parts: list[StepPart], world: int) -> dict[str, np.ndarray]:
    """The per-rank figures of several parts of one step, merged, as arrays.

    >>> from detectors.align import Instance
    >>> from detectors.parts import StepPart
    >>> from schemas.enums import CollOp, CommRole
    >>> def dp(ranks, arrivals):  # a data-parallel all-reduce that ends at 70
    ...     n = len(ranks)
    ...     return Instance("j", 5, 0, CollOp.ALL_REDUCE, -1, n, 8, ranks, arrivals,
    ...                     arrivals, (70,) * n)
    >>> a, b = StepPart(0), StepPart(0)
    >>> a.fold(dp((1, 2), (50, 60)), "dp_sync", None, CommRole.DP, None)
    >>> b.fold(dp((1,), (40,)), "dp_sync", None, CommRole.DP, None)
    >>> d = dense_ranks([a, b.seal()], 3)
    >>> d["wait"].tolist(), d["first"].tolist()
    ([0.0, 10.0, 0.0], [-1, 40, 60])
    """
    sealed = [(p.sealed if p.sealed is not None else figures(p)) for p in parts]
    cols = np.concatenate(sealed, axis=1) if sealed else np.zeros((3 + len(_SUMS), 0))
    bases = np.repeat(
        np.array([p.start if p.start != _NEVER else 0 for p in parts], dtype=np.int64),
        [s.shape[1] for s in sealed],
    )
    ranks = cols[0].astype(np.int64)
    out = {  # float even with no instances at all (parts sent empty: bincount gives ints)
        name: np.bincount(ranks, weights=cols[1 + i], minlength=world)[:world].astype(float)
        for i, name in enumerate(_SUMS)
    }
    first = np.full(world, _NEVER, dtype=np.int64)
    np.minimum.at(first, ranks, cols[-2].astype(np.int64) + bases)
    first[first == _NEVER] = -1
    out["first"] = first
    last_end = np.zeros(world, dtype=np.int64)
    np.maximum.at(last_end, ranks, cols[-1].astype(np.int64) + bases)
    out["last_end"] = last_end
    return out


def figures(p: StepPart) -> np.ndarray:
    """``p``'s per-rank figures, computed from its folded instances (:meth:`StepPart.fold`)
    as one array, a column per rank (several parts' columns are concatenated: a rank's
    sums, least first arrival and greatest last end over its columns are its figures).
    Rows: rank, the sums of ``_SUMS``, first arrival and last end as offsets from the
    part's start (exact in a float up to 104 days)."""
    folded = p.folded
    if not folded:
        return np.zeros((3 + len(_SUMS), 0))
    base = p.start if p.start != _NEVER else 0
    got = None if _native is None else _native.figures(folded, base)
    if got is not None:  # the compiled core did (None: what it does not take)
        buf, k = got
        return np.frombuffer(buf, dtype=np.float64).reshape(3 + len(_SUMS), k)
    return reference_figures(folded, base)


def reference_figures(folded: list, base: int) -> np.ndarray:
    """:func:`figures` of a part's ``folded`` instances, with NumPy: the reference of the
    compiled core (``detectors/_figures.c``), and what runs where it was not built."""
    # gathered by C-level iterators (map, attrgetter, chain): a part folds hundreds of
    # instances, and a Python generator per column cost most of this function
    insts = list(map(itemgetter(0), folded))
    n = len(insts)
    sizes = np.fromiter(map(len, map(attrgetter("ranks"), insts)), np.int64, n)
    flags = np.repeat(np.fromiter(map(itemgetter(1), folded), np.int64, n), sizes)
    m = int(sizes.sum())
    col = lambda name: np.fromiter(  # noqa: E731
        itertools.chain.from_iterable(map(attrgetter(name), insts)), np.int64, m
    )
    rank, arr, end, enq = col("ranks"), col("arrival"), col("end"), col("enqueue")
    k = int(sizes[0])
    if k and (sizes == k).all():
        by_rank = rank.reshape(n, k)
        if (by_rank == by_rank[0]).all():  # the same members in every instance: the usual
            return _member_figures(  # case, a group's part, whose figures are reductions
                by_rank[0], arr.reshape(n, k), end.reshape(n, k), enq.reshape(n, k),
                flags[::k], base,
            )  # fmt: skip
    return _any_figures(rank, arr, end, enq, flags, sizes, base)


def _any_figures(
    rank: np.ndarray,
    arr: np.ndarray,
    end: np.ndarray,
    enq: np.ndarray,
    flags: np.ndarray,
    sizes: np.ndarray,
    base: int,
) -> np.ndarray:
    """:func:`figures` of any part: its instances' members, arrivals, ends, enqueue
    times and flags one after another, ``sizes`` members an instance."""
    m = len(rank)
    starts = np.cumsum(sizes) - sizes
    inst = np.repeat(np.arange(len(sizes)), sizes)
    a_min = np.minimum.reduceat(arr, starts)
    a_max = np.maximum.reduceat(arr, starts)
    who, at = np.unique(rank, return_inverse=True)
    k = len(who)
    first = np.full(k, _NEVER, dtype=np.int64)
    np.minimum.at(first, at, arr)
    last = np.zeros(k, dtype=np.int64)
    np.maximum.at(last, at, end)
    tp = (flags & _WAIT_MODEL) > 0
    anyc = (flags & _ANY) > 0
    rel = arr - a_min[inst]  # small: exact in a float
    mean = np.add.reduceat(rel, starts) / sizes
    lateness = np.where(tp, rel - mean[inst], 0.0)
    # exclusive blame: the last to arrive (the highest rank among ties) for the time
    # after the one before it
    order = np.lexsort((np.arange(m), arr, inst))
    tail = (starts + sizes)[(sizes >= 2) & tp[starts]]
    late, before = order[tail - 1], order[tail - 2]
    tail_any = (starts + sizes)[(sizes >= 2) & anyc[starts]]
    late_any, before_any = order[tail_any - 1], order[tail_any - 2]
    rows = [
        who,
        np.bincount(at, weights=arr - enq, minlength=k),
        np.bincount(at, minlength=k),
        np.bincount(at, weights=a_max[inst] - arr, minlength=k),
        np.bincount(at, weights=lateness, minlength=k),
        np.bincount(at[late], weights=arr[late] - arr[before], minlength=k),
        np.bincount(at[late_any], weights=arr[late_any] - arr[before_any], minlength=k),
        first - base,
        last - base,
    ]
    return np.array(rows, dtype=np.float64)


def _last_blame(arrivals: np.ndarray, k: int) -> np.ndarray:
    """Exclusive blame per member over instances (rows) of ``k`` members: the last to
    arrive (the highest member among ties) for the time after the one before it."""
    if k < 2 or not len(arrivals):
        return np.zeros(k)
    order = np.argsort(arrivals, axis=1, kind="stable")
    late, before = order[:, -1], order[:, -2]
    rows = np.arange(len(order))
    got = arrivals[rows, late] - arrivals[rows, before]
    return np.bincount(late, weights=got, minlength=k)


def _member_figures(
    who: np.ndarray,
    arr: np.ndarray,
    end: np.ndarray,
    enq: np.ndarray,
    flags: np.ndarray,
    base: int,
) -> np.ndarray:
    """:func:`figures` of a part whose instances all have the members ``who``: arrivals,
    ends and enqueue times an instance a row, a member a column; ``flags`` an instance's
    (see :meth:`StepPart.fold`). Equal to the general computation, bit for bit: its sums
    of integers are exact either way, and the one sum of fractions (lateness) adds the
    instances in their order, as ``np.bincount`` does."""
    n, k = arr.shape
    tp = (flags & _WAIT_MODEL) > 0
    anyc = (flags & _ANY) > 0
    a_min = arr.min(axis=1)
    rel = arr - a_min[:, None]  # small: exact in a float
    mean = rel.sum(axis=1) / k
    lateness = np.where(tp[:, None], rel - mean[:, None], 0.0)
    blame, blame_any = _last_blame(arr[tp], k), _last_blame(arr[anyc], k)
    rows_out = [
        who,
        (arr - enq).sum(axis=0),
        np.full(k, n),
        (arr.max(axis=1)[:, None] - arr).sum(axis=0),
        np.cumsum(lateness, axis=0)[-1],  # in instance order
        blame,
        blame_any,
        arr.min(axis=0) - base,
        np.maximum(end.max(axis=0), 0) - base,
    ]
    return np.array(rows_out, dtype=np.float64)


def _core() -> ModuleType | None:
    """The compiled core; None where it was not built (no C compiler at install time:
    :func:`reference_figures` does the same, slower)."""
    try:
        from detectors import _figures
    except ImportError:
        return None
    from detectors.align import Instance

    at = Instance._fields.index
    _figures.configure(at("ranks"), at("enqueue"), at("arrival"), at("end"), _WAIT_MODEL, _ANY)
    return _figures


_native = _core()


def core_name() -> str:
    """Which code computes a part's figures (what a benchmark's numbers were measured
    with)."""
    if _native is not None:
        return "compiled (detectors/_figures.c)"
    return "NumPy (the compiled core was not built: no C compiler at install)"


__all__ = ["ANY", "NEVER", "SUMS", "WAIT_MODEL", "core_name", "dense_ranks", "figures"]
