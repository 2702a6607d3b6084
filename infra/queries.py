"""The questions the command line asks of ClickHouse, each a function returning plain
values (the SQL of the dashboards lives with them in ``infra/grafana``)."""

from __future__ import annotations

from typing import Any, NamedTuple


class StepAccount(NamedTuple):
    """A job's steps as stored: how many, their mean duration, how many the detectors left
    out (closed without some of their collectives, or a restart or a checkpoint in them),
    and the most collectives that came after their step closed."""

    steps: int
    mean_ms: float
    cut: int
    after_close: int


class AlignAccount(NamedTuple):
    """How a job's collective records met: communicators, records read, late ones, ones out of
    order, and instances reported partial."""

    comms: int
    records: int
    late: int
    out_of_order: int
    partial: int


def dead_letter_counts(client: Any, database: str) -> list[tuple[str, int]]:
    """Refused records per reason."""
    return [
        (str(reason), int(n))
        for reason, n in client.query(
            f"SELECT reason, count() FROM {database}.dead_letters FINAL "
            "GROUP BY reason ORDER BY reason"
        ).result_rows
    ]


def step_account(client: Any, database: str, job: str) -> StepAccount:
    ((n, mean_ms, cut, after_close),) = client.query(
        f"SELECT count(), round(avg(duration_ns) / 1e6, 1), "
        f"countIf(left_out), max(late_instances) "
        f"FROM {database}.steps FINAL WHERE job = {{j:String}}",
        parameters={"j": job},
    ).result_rows
    return StepAccount(int(n), float(mean_ms or 0.0), int(cut), int(after_close or 0))


def align_account(client: Any, database: str, job: str) -> AlignAccount:
    ((comms, read, late, unordered, partial),) = client.query(
        "SELECT count(), sum(records), sum(late_records), sum(out_of_order_records), "
        f"sum(partial_reports) FROM {database}.comm_accounts WHERE job = {{j:String}}",
        parameters={"j": job},
    ).result_rows
    return AlignAccount(*(int(x or 0) for x in (comms, read, late, unordered, partial)))
