"""The compiled reader of MEGATRACE call logs (producers/_calllog.c) against its Python
reference (:func:`producers.megatrace_lines.parse_calls`).

Lines are generated from the format's parts, each part valid or broken in the ways a
real file breaks (a torn line, a missing field, odd spacing, numbers too long for 64
bits, a stream that is no pointer); both readers must take exactly the same lines, as
the same values, and leave out the same others.
"""

from __future__ import annotations

import random

import pytest

import producers.megatrace_lines as lines
from producers.megatrace_lines import CallLine, parse_calls, parse_text

_FUNCS = ["AllReduce", "AllGather", "ReduceScatter", "Broadcast", "Reduce", "Send", "Recv",
          "Foo", "allreduce"]  # fmt: skip
_BLANKS = [" ", " ", " ", "\t", "  ", " \t", ""]
_STREAMS = ["0x55f615683660", "0X1A", "0x7fffffffffffffffff", "(nil)", "12", "-3", "1_0",
            "0x_1", "0x", "zz", "0xg1", "nil", "0x1f2e3d4c5b6a7988"]  # fmt: skip
_COUNTS = ["1", "1048576", "007", "18446744073709551616", "99999999999999999999999"]
_SECONDS = ["1746686438", "1", "0", "17466864381746686438", "999999999"]
_FRACS = ["086068203", "5", "0860682031", "000000000", "12345678901234567890", "1"]
_OPCOUNTS = ["", "0", "0x1f", "17", "012", "1f", "-5", "0b101", "99999999999999999999"]
_HASHES = ["", "-9046213624546410131", "9046213624546410131", "0", "-0", "18446744073709551615",
           "-18446744073709551616", "123456789012345678901234", "x1"]  # fmt: skip
_TAILS = ["", " ", "\r", " \t\r", "\r ", " junk", "\v"]


def _line(rnd: random.Random) -> str:
    def pick(parts: list[str]) -> str:  # each list's first two are what the collector writes
        return rnd.choice(parts[:2] if rnd.random() < 0.9 else parts)

    head = rnd.choice(["", "", "  ", "\t", f"[save_count {rnd.randint(0, 99)}]{pick(_BLANKS)}"])
    line = (
        f"{head}[{pick(_SECONDS)}.{pick(_FRACS)}]{pick(_BLANKS)}[Rank {rnd.randint(0, 99)}]"
        f"{pick(_BLANKS)}Fun {pick(_FUNCS)}{pick(_BLANKS)}Data {pick(_COUNTS)}{pick(_BLANKS)}"
        f"stream {pick(_STREAMS)}"
    )
    if (opc := pick(_OPCOUNTS)) or rnd.random() < 0.1:
        line += f"{pick(_BLANKS)}opCount {opc}"
    if (gh := pick(_HASHES)) or rnd.random() < 0.1:
        line += f"{pick(_BLANKS)}groupHash {gh}"
    line += pick(_TAILS)
    if rnd.random() < 0.05:  # torn: the collector's writer stopped mid-line
        line = line[: rnd.randint(0, len(line))]
    return line


def _text(seed: int, n: int = 3000) -> str:
    rnd = random.Random(seed)
    out = [_line(rnd) if rnd.random() < 0.9 else rnd.choice(["", "NCCL INFO x", " "])
           for _ in range(n)]  # fmt: skip
    return "\n".join(out) + rnd.choice(["", "\n", "\n\n"])


def test_the_compiled_reader_is_built() -> None:
    assert lines._native is not None, (
        "producers/_calllog.c was not built: `pip install -e .` compiles it when a C "
        "compiler is there (without one, megatrace reads call logs with slower Python code)"
    )


@pytest.mark.parametrize("seed", range(6))
def test_both_readers_take_the_same_lines_as_the_same_values(seed: int) -> None:
    if lines._native is None:
        pytest.skip("the compiled reader was not built")
    text = _text(seed)
    native = lines._native.parse(text, CallLine, lines._FUNCS)
    reference = parse_calls(text)
    assert native == reference
    assert [type(c) for c in native] == [CallLine] * len(native)
    # the generated lines are what a reader meets: both kinds, and each broken way
    assert 0.2 < len(reference) / text.count("\n") < 0.8
    assert {c.stream for c in reference} >= {0, 26, 0x55F615683660}


def test_a_text_that_is_not_ascii_is_read_by_the_reference() -> None:
    if lines._native is None:
        pytest.skip("the compiled reader was not built")
    text = (
        "[1.5] [Rank 0] Fun AllReduce Data 8 stream 0x1 \u00e9\n"
        "[2.0] [Rank \u0661] Fun Send Data 8 stream 0x2\n"
    )
    assert lines._native.parse(text, CallLine, lines._FUNCS) is None
    calls, other = parse_text(text)
    assert [(c.rank, c.stream) for c in calls] == [(1, 2)]  # Unicode's digit one, as re reads it
    assert other == 1


def test_a_null_stream_is_the_default_stream_and_a_stream_that_is_no_pointer_is_left_out() -> None:
    """glibc writes ``%p`` of a null pointer as ``(nil)``: a call on the default stream."""
    text = (
        "[1.5] [Rank 3] Fun AllReduce Data 8 stream (nil)\n"
        "[1.6] [Rank 3] Fun AllReduce Data 8 stream 0xzz\n"
        "[1.7] [Rank 3] Fun AllReduce Data 8 stream 0x10 opCount 0x2 groupHash -1\n"
    )
    calls, other = parse_text(text)
    assert [(c.ts_ns, c.stream, c.op_count, c.group_hash) for c in calls] == [
        (1_500_000_000, 0, None, None),
        (1_700_000_000, 16, 2, 2**64 - 1),
    ]
    assert other == 1
    with pytest.raises(lines.LogFormatError, match="stream '0xzz' is not a pointer"):
        lines.parse_line("[1.6] [Rank 3] Fun AllReduce Data 8 stream 0xzz")
