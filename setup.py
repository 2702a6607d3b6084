"""The one thing pyproject.toml cannot say yet without an experimental table: the compiled
parts, the core of the collective alignment (detectors/_align.c) and the RowBinary
encoder of ClickHouse rows (infra/_rowbinary.c). Both are optional: without a C compiler
the install goes on, detectors/align.py runs its Python reference code, and rows go to
ClickHouse as JSON."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("detectors._align", ["detectors/_align.c"], optional=True),
        Extension("infra._rowbinary", ["infra/_rowbinary.c"], optional=True),
    ]
)
