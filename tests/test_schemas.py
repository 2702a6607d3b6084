"""The wire schema: round trips, strict decoding with clear errors, the JSON Schema export."""

from __future__ import annotations

import json

import jsonschema
import msgspec
import pytest

from schemas.codec import (
    ALL_TYPES,
    SchemaError,
    decode,
    decode_as,
    encode,
    json_schema,
    read_jsonl,
    write_jsonl,
)
from schemas.enums import DeadLetterReason
from schemas.records import Collective, Heartbeat
from tests.examples import every_record


def test_every_type_has_an_example() -> None:
    assert {type(r) for r in every_record()} == set(ALL_TYPES)


@pytest.mark.parametrize("record", every_record(), ids=lambda r: type(r).__name__)
def test_round_trip_is_exact(record: msgspec.Struct) -> None:
    assert decode(encode(record)) == record


def test_decoded_records_are_left_out_of_the_cyclic_garbage_collector() -> None:
    import gc

    from schemas.records import DeadLetter

    for record in every_record():
        if not isinstance(record, DeadLetter):  # the flow's own, and rare
            assert not gc.is_tracked(decode(encode(record))), type(record).__name__


def test_big_comm_hash_survives_json() -> None:
    rec = every_record()[3]
    assert rec.comm_hash > 2**63
    assert json.loads(encode(rec))["comm_hash"] == rec.comm_hash


def _hb(**change: object) -> bytes:
    base = {"type": "hb", "v": 1, "job": "j", "node": "n", "rank": 3, "ts_ns": 5}
    base.update(change)
    return json.dumps({k: v for k, v in base.items() if v is not ...}).encode()


@pytest.mark.parametrize(
    ("raw", "reason", "field", "words"),
    [
        (b'{"type": "hb", "job": ', DeadLetterReason.MALFORMED, None, "not valid JSON"),
        (b"[1, 2]", DeadLetterReason.MALFORMED, None, "JSON object"),
        (_hb(type="nope"), DeadLetterReason.UNKNOWN_TYPE, "type", "'nope'"),
        (_hb(v=7), DeadLetterReason.UNKNOWN_VERSION, "v", "version 7"),
        (_hb(rank=...), DeadLetterReason.MISSING_FIELD, "rank", "missing field 'rank'"),
        (_hb(rank="three"), DeadLetterReason.WRONG_TYPE, "rank", "Expected `int`"),
        (_hb(rank=-1), DeadLetterReason.OUT_OF_RANGE, "rank", ">= 0"),
        (_hb(rank=10**9), DeadLetterReason.OUT_OF_RANGE, "rank", "<= 1048576"),
        (_hb(comms=[{"comm_hash": "x"}]), DeadLetterReason.WRONG_TYPE, "comms", "comm_hash"),
    ],
)
def test_bad_input_gets_a_typed_error_naming_the_problem(
    raw: bytes, reason: DeadLetterReason, field: str | None, words: str
) -> None:
    with pytest.raises(SchemaError) as info:
        decode(raw)
    assert info.value.reason == reason
    assert info.value.field == field
    assert words in str(info.value)


def test_unknown_version_wins_over_field_errors() -> None:
    # a v2 record may have other fields: the version is what the user must hear about
    with pytest.raises(SchemaError) as info:
        decode(b'{"type": "coll", "v": 2, "job": "j", "something_new": 1}')
    assert info.value.reason == DeadLetterReason.UNKNOWN_VERSION


def test_cross_field_inconsistency_is_refused() -> None:
    good = msgspec.json.decode(encode(every_record()[3]))
    good["rank_in_comm"] = 9  # comm_size is 2
    with pytest.raises(SchemaError) as info:
        decode(json.dumps(good))
    assert info.value.reason == DeadLetterReason.INCONSISTENT
    assert "rank_in_comm 9" in str(info.value)


def test_decode_as_checks_the_type() -> None:
    with pytest.raises(SchemaError, match="expected a 'coll' record"):
        decode_as(_hb(), Collective)
    assert isinstance(decode_as(_hb(), Heartbeat), Heartbeat)


def test_jsonl_files_round_trip_and_name_the_bad_line(tmp_path) -> None:
    path = tmp_path / "r.jsonl"
    assert write_jsonl(path, every_record()) == len(ALL_TYPES)
    assert list(read_jsonl(path)) == every_record()
    with open(path, "ab") as fh:
        fh.write(_hb(rank=-5) + b"\n")
    bad_line = len(ALL_TYPES) + 1
    with pytest.raises(SchemaError, match=rf"r\.jsonl:{bad_line}: invalid field 'rank'"):
        list(read_jsonl(path))


def test_json_schema_accepts_our_records_and_rejects_bad_ones() -> None:
    schema = json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    for rec in every_record():
        validator.validate(msgspec.json.decode(encode(rec)))
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(json.loads(_hb(rank=-1)))
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(json.loads(_hb(rank=...)))
