"""Secrets that never print, and URLs shown with their credentials masked.

A :class:`Secret` holds a password, a token or a webhook's URL; its ``repr`` and ``str``
are stars, so a setting printed, logged or put in an error message gives nothing away.
:func:`redact_url` shows a URL (a broker's, ClickHouse's, a webhook's) with whatever may
hold a credential replaced by ``***``.

>>> Secret("hunter2"), str(Secret(""))
(Secret('********'), "Secret('')")
"""

from __future__ import annotations


class Secret:
    """A string that never prints itself (passwords, tokens, webhook secrets)."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def get(self) -> str:
        """The secret itself; call only where it is handed to a client library."""
        return self._value

    def __bool__(self) -> bool:
        return bool(self._value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)

    def __repr__(self) -> str:
        return "Secret('********')" if self._value else "Secret('')"

    __str__ = __repr__


def redact_url(url: str, whole_path: bool = False) -> str:
    """The URL with whatever may hold a credential replaced by ``***``: the userinfo's
    password (the user name alone is kept, unless it is all there is: a token), the
    query and the fragment, and any path beyond its first segment (a database name);
    with ``whole_path``, every path segment (a webhook's token may be any of them).

    It is parsed from the right: a password may hold ``/``, ``?`` or ``#`` unencoded, so
    the authority ends at the last ``@``, and everything after the host is masked
    rather than read.

    >>> redact_url("http://bob:pw@ch:8123/db")
    'http://bob:***@ch:8123/db'
    >>> redact_url("http://bob:p#w/x?y@ch:8123/db")
    'http://bob:***@ch:8123/db'
    >>> redact_url("https://hooks.slack.com/services/T0/B0/XYZ")
    'https://hooks.slack.com/services/***'
    >>> redact_url("https://hooks.example.com/T0KEN", whole_path=True)
    'https://hooks.example.com/***'
    >>> redact_url("https://example.com/hook#t0ken")
    'https://example.com/hook#***'
    >>> redact_url("https://t0ken@example.com/")
    'https://***@example.com/'
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "***" if url else ""
    if scheme == "chdb":
        return url
    auth = ""
    at = rest.rfind("@")
    if at >= 0:
        userinfo, rest = rest[:at], rest[at + 1 :]
        user, colon, _ = userinfo.partition(":")
        auth = f"{user}:***@" if colon and user else "***@"
    cut = min([i for i in (rest.find(c) for c in "/?#") if i >= 0], default=len(rest))
    host, tail = rest[:cut], rest[cut:]
    shown = ("/***" if tail.strip("/?#") else tail) if whole_path else _first_segment(tail)
    return f"{scheme}://{auth}{host}{shown}"


def _first_segment(tail: str) -> str:
    """A URL's path, query and fragment with only the first path segment shown."""
    if not tail:
        return ""
    if tail[0] != "/":
        return tail[0] + "***"  # a query or fragment straight after the host
    rest = tail[1:]
    cut = min([i for i in (rest.find(c) for c in "/?#") if i >= 0], default=len(rest))
    first, more = rest[:cut], rest[cut:]
    return f"/{first}" + (more[0] + "***" if more.strip("/") else more)
