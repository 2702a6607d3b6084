"""The compiled per-rank figures (detectors/_figures.c) against their NumPy reference.

Both take a part's folded instances; the test folds the kinds a real part holds (one
group's instances, the same members every time; a mix of groups and transfers; ties at
the last arrival; members that never ended) and asks for the same floats, bit for bit.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

import detectors.rank_figures as rf
from detectors.align import Instance
from detectors.rank_figures import ANY, WAIT_MODEL, figures, reference_figures
from schemas.enums import CollOp

built = pytest.mark.skipif(rf._native is None, reason="detectors/_figures.c not built")


def test_the_compiled_core_is_built() -> None:
    assert rf._native is not None, (
        "detectors/_figures.c was not built: `pip install -e .` compiles it when a C "
        "compiler is there (without one, megatrace runs the slower NumPy code)"
    )


def _instance(rnd: random.Random, seq: int, ranks: tuple[int, ...], t: int) -> Instance:
    n = len(ranks)
    arr = tuple(t + rnd.choice((0, 0, 5, rnd.randrange(10**6))) for _ in ranks)  # ties too
    enq = tuple(a - rnd.randrange(-50, 10**5) for a in arr)  # the host ahead, or behind
    end = tuple(-1 if rnd.random() < 0.03 else max(arr) + rnd.randrange(10**6) for _ in ranks)
    return Instance("j", 7, seq, CollOp.ALL_REDUCE, -1, n, 64, ranks, enq, arr, end)


def _folded(seed: int, same: bool) -> tuple[list[tuple[Instance, int]], int]:
    rnd = random.Random(seed)
    t0 = 1_790_000_000 * 10**9 + rnd.randrange(10**9)
    group = tuple(rnd.sample(range(64), rnd.choice((1, 2, 4, 8))))  # members in any order
    out = []
    for seq in range(rnd.randrange(1, 300)):
        ranks = group if same else tuple(rnd.sample(range(64), rnd.choice((1, 2, 3, 8))))
        flags = rnd.choice((0, WAIT_MODEL, ANY, WAIT_MODEL | ANY))
        out.append((_instance(rnd, seq, ranks, t0 + seq * 10**7), flags))
    return out, t0 - rnd.randrange(10**6)


@built
@pytest.mark.parametrize("same", [True, False], ids=["one-group", "mixed"])
def test_the_compiled_figures_equal_the_reference_bit_for_bit(same: bool) -> None:
    for seed in range(200):
        folded, base = _folded(seed, same)
        buf, k = rf._native.figures(folded, base)
        got = np.frombuffer(buf, dtype=np.float64).reshape(-1, k)
        want = reference_figures(folded, base)
        assert got.shape == want.shape, seed
        assert got.tobytes() == want.tobytes(), (seed, np.argwhere(got != want)[:5])


@built
def test_a_time_past_64_bits_is_refused_not_wrapped() -> None:
    class Part:  # what figures() reads of a StepPart
        start = 0

    folded, _ = _folded(1, same=True)
    inst, flags = folded[0]
    Part.folded = [(inst._replace(arrival=(2**64,) * len(inst.ranks)), flags)]
    assert rf._native.figures(Part.folded, 0) is None  # the core leaves it to the reference
    with pytest.raises(OverflowError):
        figures(Part)
