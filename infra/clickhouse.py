"""ClickHouse access with one code path for the embedded engine and a real server.

``chdb:///DIR`` opens the embedded engine (chDB) in DIR through
clickhouse-connect's ``chdb`` interface; ``http(s)://user:pass@host:port/db``
talks to a server. Everything else (DDL, inserts, reads) is the same.
chDB allows one process per data directory; inside a process the client of a
directory is shared.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import msgspec

from infra import rowbinary
from schemas.codec import encode
from schemas.tables import TABLES, table_for
from schemas.views import VIEWS


class ClickHouseError(RuntimeError):
    """ClickHouse could not be reached or refused a statement."""


_embedded: dict[str, Any] = {}
_lock = threading.Lock()


def connect(url: str) -> Any:
    """A clickhouse-connect client for ``url`` (see the module docstring)."""
    try:
        import clickhouse_connect
    except ImportError:
        raise ClickHouseError("pip install 'clickhouse-connect[chdb]>=1.12'") from None
    parts = urlsplit(url)
    if parts.scheme == "chdb":
        path = str(Path(unquote(parts.netloc + parts.path)).resolve())
        with _lock:
            if path not in _embedded:
                if _embedded:
                    raise ClickHouseError(
                        f"this process already opened the embedded ClickHouse at "
                        f"{next(iter(_embedded))}; chDB allows one data directory per process, "
                        f"so {path} cannot be opened too"
                    )
                Path(path).mkdir(parents=True, exist_ok=True)
                try:
                    client = clickhouse_connect.get_client(interface="chdb", path=path)
                except Exception as e:
                    if (Path(path) / "status").exists():
                        raise ClickHouseError(
                            f"the embedded ClickHouse at {path} is in use by another process "
                            f"(chDB opens a data directory in one process at a time): stop "
                            f"it, or give this one a directory of its own (--clickhouse-url "
                            f"chdb:///OTHER_DIR)"
                        ) from None
                    raise ClickHouseError(
                        f"cannot open the embedded ClickHouse at {path}: {_first_line(e)}"
                    ) from None
                _embedded[path] = client
            return _embedded[path]
    if parts.scheme in ("http", "https"):
        from schemas.secrets import redact_url

        try:
            return clickhouse_connect.get_client(
                host=parts.hostname or "localhost",
                port=parts.port or (8443 if parts.scheme == "https" else 8123),
                username=unquote(parts.username or "default"),
                password=unquote(parts.password or ""),
                database=parts.path.strip("/") or "default",
                secure=parts.scheme == "https",
            )
        except Exception as e:
            reason = _first_line(e)
            if "Failed to establish a new connection" in reason or "Max retries" in reason:
                reason = "connection refused or host unreachable"
            raise ClickHouseError(
                f"cannot reach ClickHouse at {redact_url(url)}: {reason}"
            ) from None
    raise ClickHouseError(
        f"unsupported ClickHouse URL scheme {parts.scheme!r}: use chdb:///DIR or http(s)://..."
    )


def _squash(type_name: str) -> str:
    return "".join(type_name.split())


def _add_columns(
    client: Any, database: str, table: str, columns: list[tuple[str, str]], have: dict[str, str]
) -> None:
    """Add the ``columns`` a table lacks, each after the one before it in the record."""
    for i, (name, type_name) in enumerate(columns):
        if name in have:
            continue
        after = f" AFTER `{columns[i - 1][0]}`" if i else " FIRST"
        client.command(
            f"ALTER TABLE {database}.{table} ADD COLUMN IF NOT EXISTS `{name}` {type_name}{after}"
        )


def init_db(client: Any, database: str, retention_days: int) -> list[str]:
    """Create the database, every table and the query model's views (idempotent);
    return the table names.

    A table made by an older megatrace that lacks columns this version added gets them
    (``ALTER TABLE ... ADD COLUMN``; its old rows read the type's default: 0, empty or
    NULL, which each record type documents). One with other columns, a column of
    another type, or another key is an error that says so, rather than inserts failing
    or rows replacing each other later.
    """
    client.command(f"CREATE DATABASE IF NOT EXISTS {database}")
    for table in TABLES.values():
        client.command(table.ddl(database, retention_days))
        rows = client.query(f"DESCRIBE TABLE {database}.{table.name}").result_rows
        have = {r[0]: _squash(r[1]) for r in rows if r[2] != "MATERIALIZED"}
        want = {n: _squash(t) for n, t in table.columns}
        if have.items() <= want.items():  # the same, or columns added since
            _add_columns(client, database, table.name, table.columns, have)
        else:
            diff = sorted(set(have.items()) ^ set(want.items()))
            raise ClickHouseError(
                f"table {database}.{table.name} exists with a different schema ({diff[:4]}...): "
                f"it was made by another megatrace version; drop it or use another database"
            )
        key = client.query(
            "SELECT sorting_key FROM system.tables WHERE database = {db:String} "
            "AND name = {name:String}",
            parameters={"db": database, "name": table.name},
        ).result_rows[0][0]
        key = _squash(key)
        if key.startswith("(") and key.endswith(")"):  # one column: ClickHouse says "(job)"
            key = key[1:-1]
        if key != _squash(",".join(table.order_by)):
            raise ClickHouseError(
                f"table {database}.{table.name} exists with another key ({key}: this version "
                f"orders rows by {', '.join(table.order_by)}, and rows with equal keys replace "
                f"each other): it was made by another megatrace version; drop it or use "
                f"another database"
            )
    for view in VIEWS:
        client.command(view.ddl(database, retention_days))
    return list(TABLES)


_JSON_INSERT = {
    "input_format_skip_unknown_fields": 1,
    "date_time_input_format": "best_effort",
    # the flow's batches are small for parallel parsing, whose threads compete with the
    # flow's on a small machine; a replaced row is merged away later anyway
    "input_format_parallel_parsing": 0,
    "optimize_on_insert": 0,
}
_BINARY_INSERT = {"optimize_on_insert": 0}


def insert_json(client: Any, database: str, table: str, rows: list[bytes]) -> int:
    """Insert records' JSON (one encoded record per item) into ``table``."""
    if rows:
        client.raw_insert(
            f"{database}.{table}",
            insert_block=b"\n".join(rows),
            fmt="JSONEachRow",
            settings=_JSON_INSERT,
        )
    return len(rows)


#: rows of one table: the records themselves, or their JSON (as it came from Kafka)
Rows = list[msgspec.Struct] | list[bytes]


def insert_rows(
    client: Any, database: str, table: str, rows: Rows, *, into: str | None = None
) -> int:
    """Insert ``rows`` into ``table`` (or ``into``, a table of the same columns): records
    as ``RowBinary`` where the table has a plan (:func:`~infra.rowbinary.plan_for`), else
    as JSON, as JSON rows are.

    A list that mixes JSON and records (rows gathered before and after an upgrade that
    began handing records) goes as JSON."""
    if not rows:
        return 0
    plan = rowbinary.plan_for(table)
    if plan is not None and not isinstance(rows[0], bytes):
        try:
            block = rowbinary.encode(plan, rows)
        except TypeError:
            if not any(isinstance(r, bytes) for r in rows):
                raise  # a record that cannot be written: its field is named
            # some are JSON: the whole list goes as JSON below
        else:
            client.raw_insert(
                f"{database}.{into or table}",
                column_names=plan.columns,
                insert_block=block,
                fmt="RowBinary",
                settings=_BINARY_INSERT,
            )
            return len(rows)
    json = [r if isinstance(r, bytes) else encode(r) for r in rows]
    return insert_json(client, database, into or table, json)


#: ClickHouse refused an insert for having more partitions (days) than it takes at once
_TOO_MANY_PARTITIONS = 252
#: error codes about the store itself, not the rows (splitting cannot help): those that
#: pass by themselves (tried again), and those an operator must fix (fatal at once)
_PASSING = frozenset(
    {
        159,  # TIMEOUT_EXCEEDED
        202,  # TOO_MANY_SIMULTANEOUS_QUERIES
        209,  # SOCKET_TIMEOUT
        210,  # NETWORK_ERROR
        236,  # ABORTED
        242,  # TABLE_IS_READ_ONLY (a replica catching up)
        243,  # NOT_ENOUGH_SPACE
    }
)
_FATAL = frozenset(
    {
        16,  # NO_SUCH_COLUMN_IN_TABLE
        60,  # UNKNOWN_TABLE
        81,  # UNKNOWN_DATABASE
        164,  # READONLY
        192,  # UNKNOWN_USER
        194,  # REQUIRED_PASSWORD
        497,  # ACCESS_DENIED
        516,  # AUTHENTICATION_FAILED
    }
)
_DAY_NS = 86_400_000_000_000
#: most days one insert spans (ClickHouse's ``max_partitions_per_insert_block`` is 100)
_DAYS_PER_INSERT = 100

#: a row ClickHouse refused even alone, with its message
Refused = tuple[Any, str]


class StoreUnavailable(ClickHouseError):
    """ClickHouse could not take an insert for a reason of its own: not the rows' fault,
    so splitting them cannot help. ``passing``: it may pass by itself (unreachable,
    overloaded), so the insert is worth trying again; else an operator must act (a
    table or database missing, no permission)."""

    def __init__(self, message: str, passing: bool) -> None:
        super().__init__(message)
        self.passing = passing


def store_rows(
    client: Any, database: str, table: str, rows: Rows, *, budget: list[int] | None = None
) -> list[Refused]:
    """Insert ``rows``; return the rows ClickHouse refuses for what they hold, each with
    its message, having stored all the others.

    A refusal for spanning too many days (ClickHouse makes a partition a day, and takes
    at most 100 in one insert: a backlog of old records) is split per 100 days. Any other
    refusal of a batch is split in halves until the rows at fault stand alone. A refusal
    that is about the store (unreachable, a table missing, read-only, full) raises
    :class:`StoreUnavailable`; so does a batch that needs more than ``budget`` inserts to
    sort out (a store refusing nearly everything is broken, not the rows)."""
    # a few bad rows among many take some 2 log2(n) inserts each to find
    budget = budget if budget is not None else [max(64, len(rows) // 20)]
    if not rows:
        return []
    budget[0] -= 1
    try:
        insert_rows(client, database, table, rows)
        return []
    except (TypeError, ValueError) as exc:  # a value the encoder cannot write
        error = f"{type(exc).__name__}: {exc}"
        code = None
    except Exception as exc:
        code = getattr(exc, "code", None)
        if not isinstance(code, int) or code in _PASSING or code in _FATAL:
            passing = code not in _FATAL  # no code: the connection, not a statement
            raise StoreUnavailable(f"{table}: {_first_line(exc)}", passing) from exc
        error = _first_line(exc)
    if len(rows) == 1:
        return [(rows[0], error)]
    if budget[0] <= 0:
        raise StoreUnavailable(
            f"ClickHouse refuses rows of {table} faster than they can be told apart: {error}",
            passing=False,
        )
    if code == _TOO_MANY_PARTITIONS:
        parts = _by_days(TABLES[table], rows)
    else:
        half = len(rows) // 2
        parts = [rows[:half], rows[half:]]
    refused: list[Refused] = []
    for part in parts:
        refused += store_rows(client, database, table, part, budget=budget)  # type: ignore[arg-type]
    return refused


def _by_days(table: Any, rows: Rows) -> list[list[Any]]:
    """``rows`` in groups of at most ``_DAYS_PER_INSERT`` days each, in day order."""
    days: dict[int, list[Any]] = {}
    for row in rows:
        days.setdefault(table.time_ns(row) // _DAY_NS, []).append(row)
    ordered = [days[d] for d in sorted(days)]
    if len(ordered) == 1:  # one day and still refused: split it in halves instead
        half = len(rows) // 2
        return [list(rows[:half]), list(rows[half:])]
    return [
        [r for group in ordered[i : i + _DAYS_PER_INSERT] for r in group]
        for i in range(0, len(ordered), _DAYS_PER_INSERT)
    ]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:500]


def insert_records(client: Any, database: str, records: Iterable[msgspec.Struct]) -> int:
    """Insert records into their tables, one insert per table; return rows written."""
    by_table: dict[str, list[msgspec.Struct]] = defaultdict(list)
    for rec in records:
        by_table[table_for(rec).name].append(rec)
    return sum(insert_rows(client, database, name, rows) for name, rows in by_table.items())


def read_records(
    client: Any,
    database: str,
    table: str,
    where: str = "",
    parameters: dict[str, Any] | None = None,
    order_by: str = "",
) -> Iterator[Any]:
    """Read a table back as records (deduplicated with FINAL)."""
    t = TABLES[table]
    sql = f"SELECT {t.select_list()} FROM {database}.{t.name} FINAL"
    if where:
        sql += f" WHERE {where}"
    if order_by:
        sql += f" ORDER BY {order_by}"
    result = client.query(sql, parameters=parameters or {})
    names = result.column_names
    for row in result.result_rows:
        yield t.from_row(dict(zip(names, row, strict=True)))
