"""The dashboards' model (:class:`Dashboard`, :class:`Panel`, :class:`Variable`), its
JSON for Grafana (:func:`render`), and the SQL Grafana would send for a panel
(:func:`expand`: the template variables and the ClickHouse plugin's macros, as they
expand for given values, time range and database).

>>> sql = "WHERE $__timeFilter(ts) AND job='${job}' AND $__conditionalAll(rank IN (${rank}), $rank)"
>>> print(expand(sql, {"job": "j1", "rank": ["3", "5"]}, (0, 60)))
WHERE ts >= toDateTime(0) AND ts <= toDateTime(60) AND job='j1' AND rank IN (3,5)
>>> print(expand("$__conditionalAll(rank IN (${rank}), $rank)", {"rank": ALL}, (0, 60)))
 1=1
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

DATASOURCE = {"type": "grafana-clickhouse-datasource", "uid": "megatrace-clickhouse"}
DB = "megatrace"  # the database name in the committed dashboards
ALL = "$__all"  # the value Grafana gives a variable when "All" is selected


@dataclass(frozen=True)
class Panel:
    """One panel: a title, a visualisation, its SQL and what the test expects of it."""

    key: str
    title: str
    kind: str  # Grafana panel type: table, timeseries, heatmap, barchart, stat
    sql: str
    format: str = "table"  # or "timeseries"
    width: int = 12
    height: int = 8
    description: str = ""
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Variable:
    name: str
    sql: str
    multi: bool = False
    include_all: bool = False


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    panels: Sequence[Panel]
    variables: Sequence[Variable] = ()
    annotations: Sequence[tuple[str, str]] = ()  # (name, SQL returning time, timeEnd, text)

    def panel(self, key: str) -> Panel:
        return next(p for p in self.panels if p.key == key)


# --------------------------------------------------------------------------- JSON


def _target(sql: str, fmt: str) -> dict[str, Any]:
    return {
        "datasource": DATASOURCE,
        "editorType": "sql",
        "format": 0 if fmt == "timeseries" else 1,
        "queryType": fmt,
        "rawSql": sql,
        "refId": "A",
    }


def to_json(d: Dashboard) -> dict[str, Any]:
    """The dashboard as Grafana's JSON model."""
    panels, x, y, row_h = [], 0, 0, 0
    for i, p in enumerate(d.panels, start=1):
        if x + p.width > 24:
            x, y, row_h = 0, y + row_h, 0
        panels.append(
            {
                "id": i,
                "type": p.kind,
                "title": p.title,
                "description": p.description,
                "datasource": DATASOURCE,
                "gridPos": {"x": x, "y": y, "w": p.width, "h": p.height},
                "options": dict(p.options),
                "targets": [_target(p.sql, p.format)],
            }
        )
        x, row_h = x + p.width, max(row_h, p.height)
    templating = [
        {
            "name": v.name,
            "type": "query",
            "datasource": DATASOURCE,
            "query": v.sql,
            "definition": v.sql,
            "multi": v.multi,
            "includeAll": v.include_all,
            "refresh": 2,
        }
        for v in d.variables
    ]
    annotations = [
        {
            "name": name,
            "enable": True,
            "iconColor": "red",
            "datasource": DATASOURCE,
            "target": _target(sql, "table"),
        }
        for name, sql in d.annotations
    ]
    return {
        "uid": d.uid,
        "title": d.title,
        "tags": ["megatrace"],
        "timezone": "utc",
        "schemaVersion": 39,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": templating},
        "annotations": {"list": annotations},
        "panels": panels,
    }


def render(d: Dashboard) -> str:
    """The dashboard's JSON file, as committed."""
    return json.dumps(to_json(d), indent=2) + "\n"


# --------------------------------------------------------------------------- SQL

_COND_ALL = re.compile(r"\$__conditionalAll\((.*?),\s*\$(\w+)\)")
_VAR = re.compile(r"\$\{(\w+)(?::(\w+))?\}|\$(\w+)\b")


def _format(value: str | list[str], how: str | None) -> str:
    values = value if isinstance(value, list) else [value]
    if how == "singlequote":
        return ",".join("'" + v.replace("'", "\\'") + "'" for v in values)
    return ",".join(values)


def expand(
    sql: str,
    variables: Mapping[str, str | list[str]],
    time_range_s: tuple[int, int],
    interval_s: int = 60,
    database: str = DB,
) -> str:
    """The SQL Grafana and the ClickHouse plugin would send, for the given variable
    values (``ALL`` for "All"), time range (Unix seconds) and database."""
    t0, t1 = time_range_s

    def cond_all(m: re.Match[str]) -> str:
        return " 1=1" if variables.get(m.group(2)) == ALL else m.group(1)

    sql = _COND_ALL.sub(cond_all, sql)
    sql = re.sub(
        r"\$__timeFilter\((\w+)\)",
        lambda m: f"{m.group(1)} >= toDateTime({t0}) AND {m.group(1)} <= toDateTime({t1})",
        sql,
    )
    sql = re.sub(
        r"\$__timeInterval\((\w+)\)",
        lambda m: f"toStartOfInterval(toDateTime({m.group(1)}), INTERVAL {interval_s} second)",
        sql,
    )
    sql = sql.replace("$__interval_s", str(interval_s))
    sql = sql.replace("$__fromTime", f"toDateTime({t0})").replace("$__toTime", f"toDateTime({t1})")

    def var(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(3)
        if name not in variables:
            raise KeyError(f"no value for template variable ${name}")
        return _format(variables[name], m.group(2))

    sql = _VAR.sub(var, sql)
    if database != DB:
        sql = re.sub(rf"\b{DB}\.", f"{database}.", sql)
    return sql


__all__ = [
    "ALL",
    "DATASOURCE",
    "DB",
    "Dashboard",
    "Panel",
    "Variable",
    "expand",
    "render",
    "to_json",
]
