"""Strict JSON codec for every record, with typed errors and dead-letter records.

The fast path decodes straight into the tagged union of record types with
msgspec (validation included). Only when that fails does the slow path work out
*why*, so a bad record costs more than a good one, never the other way round.

>>> rec = decode(b'{"type":"hb","job":"j","node":"n1","rank":4,"ts_ns":5}')
>>> type(rec).__name__, rec.rank
('Heartbeat', 4)
>>> decode(encode(rec)) == rec
True
>>> try:
...     decode(b'{"type":"hb","job":"j","node":"n1","rank":-4,"ts_ns":5}')
... except SchemaError as e:
...     print(e.reason.value, e.field)
out_of_range rank
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Annotated, Any, TypeVar, Union

import msgspec

from schemas.enums import DeadLetterReason
from schemas.files import lines
from schemas.records import EVENT_TYPES, DeadLetter
from schemas.results import RESULT_TYPES
from schemas.units import SCHEMA_VERSION

#: Every record type the codec reads and writes: the producers', the analysis', and the
#: dead letter.
ALL_TYPES: tuple[type[msgspec.Struct], ...] = (*EVENT_TYPES, *RESULT_TYPES, DeadLetter)

#: Schema versions each record tag accepts. A new version adds a line here.
SUPPORTED_VERSIONS: dict[str, frozenset[int]] = {
    t.__struct_config__.tag: frozenset({SCHEMA_VERSION}) for t in ALL_TYPES
}
_BY_TAG: dict[str, type[msgspec.Struct]] = {t.__struct_config__.tag: t for t in ALL_TYPES}
#: The tags node producers may send (everything else is megatrace's own output).
INPUT_TAGS: frozenset[str] = frozenset(t.__struct_config__.tag for t in EVENT_TYPES)

AnyRecord = Union[*ALL_TYPES]
InputRecord = Union[*EVENT_TYPES]

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(AnyRecord)
_input_decoder = msgspec.json.Decoder(InputRecord)
_raw_decoder = msgspec.json.Decoder()
_T = TypeVar("_T", bound=msgspec.Struct)
_PATH = re.compile(r"at `\$\.([A-Za-z_][A-Za-z0-9_]*)")


class SchemaError(ValueError):
    """A record that does not conform to the schema.

    ``reason`` is the dead-letter reason, ``field`` the offending field (if any).
    """

    def __init__(self, reason: DeadLetterReason, message: str, field: str | None = None):
        super().__init__(message)
        self.reason = reason
        self.field = field


def encode(record: msgspec.Struct) -> bytes:
    """Encode a record as compact JSON bytes (the wire and file format)."""
    return _encoder.encode(record)


def decode(raw: bytes | str) -> Any:
    """Decode and validate one record of any type; raise :class:`SchemaError` on any
    problem."""
    return _decode(raw, _decoder, None)


def decode_input(raw: bytes | str) -> Any:
    """Decode and validate one record that a node producer may send (job metadata and
    node events): a record type only megatrace's analysis writes (a verdict, a fault
    label, a dead letter...) is refused, so that nobody can plant one through an input.

    >>> try:
    ...     decode_input(b'{"type":"label","job":"j","fault_id":"f","kind":"hang",'
    ...                  b'"cause":"compute","onset_step":1,"onset_ns":1}')
    ... except SchemaError as e:
    ...     print(e.reason.value, e.field)
    not_an_input type
    """
    return _decode(raw, _input_decoder, INPUT_TAGS)


def _decode(raw: bytes | str, decoder: msgspec.json.Decoder, tags: frozenset[str] | None) -> Any:
    try:
        rec = decoder.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise _explain(raw, exc, tags) from None
    except RecursionError:
        raise _too_deep() from None
    tag = rec.__struct_config__.tag
    if rec.v not in SUPPORTED_VERSIONS[tag]:
        raise _unknown_version(tag, rec.v)
    return rec


def _too_deep() -> SchemaError:
    return SchemaError(
        DeadLetterReason.MALFORMED, "JSON nested deeper than a record can be (refused unread)"
    )


def decode_as(raw: bytes | str, cls: type[_T]) -> _T:
    """Decode one record that must be of type ``cls``."""
    rec = decode(raw)
    if not isinstance(rec, cls):
        raise SchemaError(
            DeadLetterReason.UNKNOWN_TYPE,
            f"expected a {cls.__struct_config__.tag!r} record, got {type(rec).__name__}",
            "type",
        )
    return rec


def _unknown_version(tag: str, version: object) -> SchemaError:
    supported = ", ".join(str(v) for v in sorted(SUPPORTED_VERSIONS[tag]))
    return SchemaError(
        DeadLetterReason.UNKNOWN_VERSION,
        f"unknown schema version {version!r} for record type {tag!r} (supported: {supported})",
        "v",
    )


def _explain(raw: bytes | str, exc: Exception, tags: frozenset[str] | None) -> SchemaError:
    """Slow path: turn a failed decode into a precise, typed error. Every value is
    checked for its type before it is used: a bad record must not break the
    explanation of why it is bad."""
    try:
        obj = _raw_decoder.decode(raw)
    except msgspec.DecodeError as e:
        return SchemaError(DeadLetterReason.MALFORMED, f"not valid JSON: {e}")
    except RecursionError:
        return _too_deep()
    if not isinstance(obj, dict):
        return SchemaError(
            DeadLetterReason.MALFORMED, f"a record is a JSON object, got {type(obj).__name__}"
        )
    tag = obj.get("type")
    if not isinstance(tag, str) or tag not in _BY_TAG:
        known = ", ".join(sorted(tags if tags is not None else _BY_TAG))
        shown = repr(tag) if isinstance(tag, str | int | float | None) else type(tag).__name__
        return SchemaError(
            DeadLetterReason.UNKNOWN_TYPE,
            f"unknown record type {shown[:80]} (known: {known})",
            "type",
        )
    if tags is not None and tag not in tags:
        return SchemaError(
            DeadLetterReason.NOT_AN_INPUT,
            f"record type {tag!r} is written by megatrace's analysis, not accepted as input "
            f"(inputs: {', '.join(sorted(tags))})",
            "type",
        )
    cls = _BY_TAG[tag]
    version = obj.get("v", SCHEMA_VERSION)
    if type(version) is not int:
        return SchemaError(
            DeadLetterReason.WRONG_TYPE,
            f"field 'v' of {tag} record is the schema version, an integer, not "
            f"{type(version).__name__}",
            "v",
        )
    if version not in SUPPORTED_VERSIONS[tag]:
        return _unknown_version(tag, version)
    fields = {f.name: f for f in msgspec.structs.fields(cls)}
    for name, f in fields.items():
        if f.required and name not in obj:
            return SchemaError(
                DeadLetterReason.MISSING_FIELD, f"{tag} record is missing field {name!r}", name
            )
    message = str(exc)
    match = _PATH.search(message)
    if match is None or match.group(1) not in fields:
        return SchemaError(DeadLetterReason.INCONSISTENT, f"invalid {tag} record: {message}")
    name = match.group(1)
    try:
        msgspec.convert(obj[name], _unconstrained(fields[name].type))
    except msgspec.ValidationError:
        reason = DeadLetterReason.WRONG_TYPE
    else:
        reason = DeadLetterReason.OUT_OF_RANGE
    return SchemaError(reason, f"invalid field {name!r} of {tag} record: {message}", name)


def _unconstrained(tp: Any) -> Any:
    """The same type with range/length constraints removed."""
    if typing.get_origin(tp) is Annotated:
        return _unconstrained(typing.get_args(tp)[0])
    args = typing.get_args(tp)
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return Union[tuple(_unconstrained(a) for a in args)]  # noqa: UP007
    if origin in (list, dict, tuple) and args:
        return origin[tuple(_unconstrained(a) for a in args)]
    return tp


def dead_letter(
    raw: bytes,
    error: SchemaError,
    *,
    now_ns: int,
    step_id: str = "",
    topic: str = "",
    partition: int = -1,
    offset: int = -1,
    key: bytes | None = None,
) -> DeadLetter:
    """The dead-letter record that keeps a refused input and says why."""
    return DeadLetter(
        ts_ns=now_ns,
        reason=error.reason,
        error=str(error),
        field=error.field,
        step_id=step_id,
        topic=topic,
        partition=partition,
        offset=offset,
        key=key,
        raw=raw,
    )


# --------------------------------------------------------------------------- files


def write_jsonl(path: Path, records: Iterable[msgspec.Struct]) -> int:
    """Write records one per line; return how many were written."""
    n = 0
    with open(path, "wb") as fh:
        for rec in records:
            fh.write(_encoder.encode(rec))
            fh.write(b"\n")
            n += 1
    return n


def read_jsonl(path: Path, inputs: bool = False) -> Iterator[Any]:
    """Read a JSON-lines file of records, compressed or not (:mod:`schemas.files`;
    ``inputs``: only what a node producer may send, see :func:`decode_input`); a bad
    line raises :class:`SchemaError` with its number, a compressed file cut short
    :class:`~schemas.files.InputFileError`."""
    read = decode_input if inputs else decode
    for lineno, line in enumerate(lines(path), 1):
        if not line.strip():
            continue
        try:
            yield read(line)
        except SchemaError as e:
            raise SchemaError(e.reason, f"{path}:{lineno}: {e}", e.field) from None


def records_file(folder: Path) -> Path | None:
    """A recording folder's records (``records.jsonl``, as ``megatrace simulate`` and
    ``megatrace lab`` leave them, or kept compressed: ``records.jsonl.gz``...); None: it
    holds none."""
    names = ("records.jsonl", "records.jsonl.gz", "records.jsonl.bz2", "records.jsonl.xz")
    return next((p for name in names if (p := Path(folder) / name).is_file()), None)


# --------------------------------------------------------------------------- JSON Schema


#: a verdict's fields as ``megatrace analyze --json`` prints each revision
VERDICT_FIELDS = ("verdict_id", "status", "kind", "cause", "rank", "node", "gpu", "link", "step",
                  "microbatch", "phase", "pp_stage", "comm_hash", "seq", "op", "onset_ns",
                  "onset_step", "detected_ns", "severity", "confidence", "summary",
                  "evidence")  # fmt: skip


def verdict_json(v: msgspec.Struct) -> dict[str, Any]:
    """A verdict's JSON form (:data:`VERDICT_FIELDS`, enums as their values)."""
    d = msgspec.to_builtins(v)
    return {k: d.get(k) for k in VERDICT_FIELDS}


def json_schema() -> dict[str, Any]:
    """A JSON Schema (2020-12) document covering every record type.

    Non-Python producers (the C profiler plugin, other agents) validate against
    this. The top level is a ``oneOf`` over the records, discriminated by ``type``.
    """
    (refs,), components = msgspec.json.schema_components([AnyRecord])
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "megatrace records",
        "description": f"megatrace record schema, version {SCHEMA_VERSION}",
        **refs,
        "$defs": components,
    }
