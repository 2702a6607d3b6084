"""The verdict book's old home (now :mod:`detectors.verdicts`): a flow's snapshots pickled
it by this name, and resume from it."""


def __getattr__(name: str) -> object:
    if name in ("VerdictBook", "verdict_id"):
        from detectors import verdicts

        return getattr(verdicts, name)
    raise AttributeError(name)
