"""Property-based fuzzing of what reads untrusted bytes: the codec and the agent's line
parser. Whatever comes in, the answer is a record that can be stored, or a schema error
with a reason; never another exception, never a record the store would refuse.

The long form, with the real broker, ClickHouse and the flow killed at random points,
is ``megatrace bench faults``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="pip install 'megatrace[test]'")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from infra.rowbinary import Plan, encode_py  # noqa: E402
from producers.agent import NodeAgent  # noqa: E402
from producers.agent_publish import unpack  # noqa: E402
from producers.sim.hostile import good_lines, hostile_lines  # noqa: E402
from schemas.codec import SchemaError, decode, decode_input, encode  # noqa: E402
from schemas.config import AgentSettings  # noqa: E402
from schemas.records import DeadLetter  # noqa: E402
from schemas.tables import TABLE_FOR  # noqa: E402
from schemas.topics import Topics  # noqa: E402

_FIELDS = sorted({k for line in good_lines() for k in json.loads(line)})
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    st.text(max_size=40),
)
_JSON = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


def _storable(rec: object) -> None:
    """A record the codec accepted goes into its table, and its JSON decodes back to it."""
    table = TABLE_FOR[type(rec)]
    try:
        plan = Plan.of(table)
    except TypeError:  # a table written as JSON (bytes fields)
        plan = None
    if plan is not None:
        encode_py(plan, [rec])
    assert decode(encode(rec)) == rec


def _check(raw: bytes) -> None:
    try:
        rec = decode_input(raw)
    except SchemaError as e:
        assert e.reason is not None and str(e)
        return
    _storable(rec)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_any_bytes_are_a_record_or_a_schema_error(raw: bytes) -> None:
    _check(raw)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(good_lines()),
    st.dictionaries(st.sampled_from([*_FIELDS, "v", "extra"]), _JSON, max_size=4),
)
def test_any_field_of_any_type_is_a_record_or_a_schema_error(line: bytes, changes: dict) -> None:
    rec = {**json.loads(line), **changes}
    _check(json.dumps(rec).encode())


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=1, max_value=30_000), st.sampled_from(["[", '{"a":']))
def test_nesting_of_any_depth_is_refused_or_read(depth: int, opener: str) -> None:
    closer = "]" if opener == "[" else "}"
    _check(f'{{"type":"hb","x":{opener * depth}1{closer * depth}}}'.encode())


def test_ten_thousand_hostile_lines_from_the_generator() -> None:
    for raw in hostile_lines(random.Random(11), 10_000):
        _check(raw)


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.one_of(st.binary(max_size=120), st.sampled_from(good_lines())), max_size=30))
def test_the_agent_takes_every_line_as_a_record_or_a_dead_letter(
    tmp_path_factory: pytest.TempPathFactory, lines: list[bytes]
) -> None:
    d = tmp_path_factory.mktemp("agent")
    agent = NodeAgent(AgentSettings(job="j", node="n"), {"bootstrap.servers": "127.0.0.1:1"},
                      Topics(), Path(d))  # fmt: skip
    try:
        lines = [x.replace(b"\n", b" ") for x in lines]
        taken = agent.accept(lines)
        wanted = sum(1 for x in lines if x.strip())
        assert taken == wanted and agent.health.accepted == wanted
        frames = [unpack(p) for p, _ in agent.spool.read(100)]
        refused = [v for t, _, v in frames if t == Topics().deadletter]
        assert len(refused) == agent.health.refused
        assert all(isinstance(decode(v), DeadLetter) for v in refused)
    finally:
        agent.spool.close()
