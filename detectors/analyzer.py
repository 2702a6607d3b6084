"""Where :class:`~detectors.job.JobAnalyzer` lived before it was split by incident: kept
so that recovery snapshots and callers of the old path still find it."""

from __future__ import annotations

from detectors.job import JobAnalyzer
from detectors.job_compat import OLD_HANG_STATE as _OLD_HANG_STATE

__all__ = ["_OLD_HANG_STATE", "JobAnalyzer"]
