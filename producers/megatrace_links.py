"""The original MEGATRACE collector's per-NIC throughput logs, read.

The collector measures each port's throughput over a sliding window of work requests
and writes a row per measurement to ``<host>_<NIC>_Port<i>_A.log``, then to ``_B.log``
once that holds 10 MB, and back, truncating each as it starts it again with its
header::

    Time,Group,FromRank,ToRank,DevIndex,Func,FuncTimes,SrcIP,DstIP,Bandwidth,SendWrCounter,RemainWrDataSize,Timestamp
    20250508143000,1234,0,8,0,4,17,10.0.0.1,10.0.0.2,180,50,0,1746686438086068203

(``Time`` local to the host, to the second; ``Bandwidth`` in Gb/s; ``Timestamp`` the
window's last send completion, ns since the epoch.)

>>> from producers.megatron_config import MegatronConfig
>>> text = "\\n".join([",".join(LINK_COLUMNS),
...     "20250508143000,1234,0,8,0,4,17,10.0.0.1,10.0.0.2,180,50,0,1746686438086068203",
...     "20250508143001,1234,0,8,0,4,1"])  # the killed job's torn last row
>>> samples, _, bad = link_samples(text, "j", MegatronConfig(world_size=16, pp=2))
>>> [(s.src_rank, s.dst_rank, s.throughput_gbps, s.ts_ns) for s in samples], bad
([(0, 8, 180.0, 1746686438086068203)], 1)
"""

from __future__ import annotations

import csv
from pathlib import Path

from producers.megatron_config import MegatronConfig
from schemas.enums import CollOp
from schemas.files import read_text
from schemas.layout import Layout, nic_name
from schemas.records import LinkSample

_CSV_FUNCS = {
    0: CollOp.BROADCAST,
    1: CollOp.REDUCE,
    2: CollOp.ALL_GATHER,
    3: CollOp.REDUCE_SCATTER,
    4: CollOp.ALL_REDUCE,
    5: CollOp.SEND,
    6: CollOp.SEND,
    7: CollOp.RECV,
}
#: the columns of the NICs' throughput logs, as the collector writes them
LINK_COLUMNS = ("Time", "Group", "FromRank", "ToRank", "DevIndex", "Func", "FuncTimes",
                "SrcIP", "DstIP", "Bandwidth", "SendWrCounter", "RemainWrDataSize",
                "Timestamp")  # fmt: skip


def read_link_csv(path: Path, job: str, cfg: MegatronConfig) -> tuple[list[LinkSample], int]:
    """A NIC's throughput log, whole (see :func:`link_samples`): its samples, and how many
    rows were left out."""
    samples, _, bad = link_samples(read_text(path, newline=""), job, cfg)
    return samples, bad


def link_samples(
    text: str, job: str, cfg: MegatronConfig, columns: tuple[str, ...] = LINK_COLUMNS
) -> tuple[list[LinkSample], tuple[str, ...], int]:
    """The samples of a NIC's throughput log's rows (bandwidth in Gb/s; ``Timestamp``, the
    send's completion, in ns), the columns to read the next rows by, and how many rows
    were left out. The collector
    writes a port's rows to ``_A.log``, then ``_B.log`` once that holds 10 MB, truncating
    each as it starts it again with its header: ``text`` may be a whole file or what was
    appended to one. A row that is torn (the collector stopped mid-write: a killed job's
    last) or not numbers where numbers go is left out, and counted."""
    lay = Layout(cfg.world_size, gpus_per_node=cfg.gpus_per_node)
    out: list[LinkSample] = []
    bad = 0
    for row in csv.reader(text.splitlines()):
        if not row or not "".join(row).strip():
            continue
        if "FromRank" in row and "Bandwidth" in row:
            columns = tuple(c.strip() for c in row)
            continue
        try:
            if len(row) != len(columns):
                raise ValueError(f"{len(row)} fields, not {len(columns)}")
            out.append(_link_sample(dict(zip(columns, row, strict=True)), job, lay))
        except (KeyError, ValueError, TypeError):
            bad += 1
    return out, columns, bad


def _link_sample(row: dict[str, str], job: str, lay: Layout) -> LinkSample:
    src, dst = int(row["FromRank"]), int(row["ToRank"])
    dev, gbps = int(row["DevIndex"]), float(row["Bandwidth"])
    if min(src, dst, dev) < 0 or not 0 <= gbps < float("inf"):
        raise ValueError("a rank, port or bandwidth out of range")
    return LinkSample(
        job=job,
        node=lay.node(src),
        rank=src,
        ts_ns=_timestamp_ns(row["Timestamp"]),
        window_ns=0,
        nic=nic_name(dev),
        src_rank=src,
        dst_rank=dst,
        dst_node=lay.node(dst),
        dst_nic=nic_name(dev),
        comm_hash=int(row["Group"]) & (2**64 - 1) if row.get("Group") else None,
        func=_CSV_FUNCS.get(int(row["Func"])) if row.get("Func") else None,
        throughput_gbps=gbps,
        wr_posted=int(row.get("SendWrCounter") or 0),
        outstanding_bytes=int(row.get("RemainWrDataSize") or 0),
    )


def _timestamp_ns(text: str) -> int:
    if "." in text:
        sec, frac = text.split(".", 1)
        return int(sec) * 1_000_000_000 + int((frac + "000000000")[:9])
    v = int(text)
    for limit, scale in ((10**17, 1), (10**14, 1_000), (10**11, 1_000_000)):
        if v > limit:
            return v * scale
    return v * 1_000_000_000


__all__ = ["LINK_COLUMNS", "link_samples", "read_link_csv"]
