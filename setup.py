"""The one thing pyproject.toml cannot say yet without an experimental table: the compiled
parts, the core of the collective alignment (detectors/_align.c), a step part's per-rank
figures (detectors/_figures.c), the RowBinary encoder of ClickHouse rows
(infra/_rowbinary.c) and the reader of MEGATRACE call logs (producers/_calllog.c). All are
optional: without a C compiler the install goes on, detectors/align.py,
detectors/rank_figures.py and producers/megatrace_lines.py run their Python reference
code, and rows go to ClickHouse as JSON."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("detectors._align", ["detectors/_align.c"], optional=True),
        Extension("detectors._figures", ["detectors/_figures.c"], optional=True),
        Extension("infra._rowbinary", ["infra/_rowbinary.c"], optional=True),
        Extension("producers._calllog", ["producers/_calllog.c"], optional=True),
    ]
)
