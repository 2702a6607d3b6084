"""The one thing pyproject.toml cannot say yet without an experimental table: the compiled
core of the collective alignment (detectors/_align.c). It is optional: without a C
compiler the install goes on, and detectors/align.py runs its Python reference code."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("detectors._align", ["detectors/_align.c"], optional=True)])
