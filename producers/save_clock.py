"""How long a process spent saving checkpoints, for the PyTorch collector's heartbeats.

:class:`SaveClock` times ``torch.save`` and ``torch.distributed.checkpoint``'s ``save``
and ``async_save`` once installed (code must call them through their modules), and any
checkpoint code marked ``with clock.saving():`` (a sync to disk, an upload). The time any
thread is inside counts once: DCP's writers call ``torch.save`` inside its ``save``, on
threads of their own. ``on_change`` is called as a save begins and as it ends (the
collector sends a heartbeat then).

>>> clock = SaveClock()
>>> with clock.saving():
...     with clock.saving():  # inside the first: one save
...         since = clock.saves(0)[1]
...         during = clock.saves(since + 5_000)
>>> during[0]
5000
>>> saved, since = clock.saves(0)
>>> saved > 0, since  # over: its time kept, none under way
(True, None)
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any


class SaveClock:
    """The process's time saving checkpoints (see the module docstring)."""

    def __init__(self, on_change: Callable[[], None] = lambda: None) -> None:
        self.on_change = on_change
        self._saved_ns = 0  # what finished saves took
        self._saving = 0  # threads saving now
        self._since: int | None = None  # when the first of them began
        self._lock = threading.Lock()
        self._tls = threading.local()
        self._originals: dict[str, tuple[Any, Any]] = {}  # "module.name" -> (module, fn)

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Checkpoint code, timed (the outermost of a thread's counts)."""
        tls = self._tls
        depth = getattr(tls, "depth", 0)
        tls.depth = depth + 1
        if not depth:
            self._moved(+1)
        try:
            yield
        finally:
            tls.depth = depth
            if not depth:
                self._moved(-1)

    def _moved(self, by: int) -> None:
        """A thread began (+1) or ended (-1) a save: the first to begin starts the clock,
        the last to end stops it."""
        now = time.time_ns()
        with self._lock:
            if by > 0 and not self._saving:
                self._since = now
            self._saving += by
            if not self._saving and self._since is not None:
                self._saved_ns += now - self._since
                self._since = None
        self.on_change()

    def saves(self, now_ns: int) -> tuple[int, int | None]:
        """The time spent saving up to ``now_ns`` (a save under way included; the count
        never goes back), and when the save under way began (None: none)."""
        with self._lock:
            saved, since = self._saved_ns, self._since
        return saved + (max(0, now_ns - since) if since is not None else 0), since

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self.saving():
                return fn(*args, **kwargs)

        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapper

    def install(self) -> None:
        """Time the checkpoint functions (:func:`checkpoint_functions`)."""
        for module, name in checkpoint_functions():
            key = f"{module.__name__}.{name}"
            if key not in self._originals:
                fn = getattr(module, name)
                self._originals[key] = (module, fn)
                setattr(module, name, self.wrap(fn))

    def uninstall(self) -> None:
        for key, (module, fn) in self._originals.items():
            setattr(module, key.rpartition(".")[2], fn)
        self._originals.clear()


def checkpoint_functions() -> list[tuple[Any, str]]:
    """The checkpoint functions timed, as (module, name): ``torch.save``, and
    ``torch.distributed.checkpoint``'s ``save`` and ``async_save`` (in the package and in
    the module that defines them) where this torch has them."""
    import torch

    out: list[tuple[Any, str]] = [(torch, "save")]
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import state_dict_saver
    except ImportError:  # a torch without DCP
        return out
    for module in (dcp, state_dict_saver):
        out += [(module, n) for n in ("save", "async_save") if hasattr(module, n)]
    return out


__all__ = ["SaveClock", "checkpoint_functions"]
