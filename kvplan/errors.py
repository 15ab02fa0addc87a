"""Exceptions a user can reach. Each names what is wrong and where.

Their text is always one bounded line: whatever came from a file (key names, values, file
names) is shown escaped (no raw newlines, ANSI escapes or other control characters, so it
cannot forge a second ``kvplan: error:`` line or drive the terminal) and truncated.
"""

from __future__ import annotations

import reprlib

MAX_VALUE_CHARS = 80  # a value shown in "(got ...)"
MAX_NAME_CHARS = 160  # a key path or file name
MAX_PROBLEM_CHARS = 300
MAX_MESSAGE_CHARS = 1000  # the whole line
_ELLIPSIS = "..."


def escape(text: str) -> str:
    """``text`` with every non-printable character (newline, ESC, NUL, U+2028...) as a Python escape."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)


def one_line(text: str, limit: int) -> str:
    """``text`` escaped onto one line and cut to at most ``limit`` characters (with an ellipsis)."""
    text = escape(text[:limit + 1])  # cut first: a 50 MB value is never escaped whole
    return text if len(text) <= limit else text[:limit - len(_ELLIPSIS)] + _ELLIPSIS


class _BoundedRepr(reprlib.Repr):
    """``repr`` that never builds more than a few hundred characters, whatever the value."""

    def __init__(self):
        super().__init__()
        self.maxlevel = 3
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = self.maxfrozenset = self.maxdeque = 6
        self.maxstring = self.maxother = self.maxlong = MAX_VALUE_CHARS

    def repr_int(self, x, level):
        if x.bit_length() > 256:  # repr() itself refuses ints over 4300 digits (ValueError)
            return f"<{'negative ' if x < 0 else ''}integer of {x.bit_length()} bits>"
        return super().repr_int(x, level)


_repr = _BoundedRepr().repr


def describe(value) -> str:
    """A short, escaped, one-line ``repr`` of a value taken from user input."""
    return one_line(_repr(value), MAX_VALUE_CHARS)


def or_list(items) -> str:
    """Choices in words for a message: ``"a, b or c"``."""
    items = [str(item) for item in items]
    return ", ".join(items[:-1]) + " or " + items[-1] if len(items) > 1 else "".join(items)


class KVPlanError(Exception):
    """Base class of kvplan's user-facing errors (the CLI prints them on one line, exit 2)."""

    def __str__(self) -> str:
        return one_line(super().__str__(), MAX_MESSAGE_CHARS)


FILE_PATH = "<file>"  # PlanError.path of a problem of the whole plan file (unreadable, too large, not UTF-8)


class PlanError(KVPlanError, ValueError):
    """A plan is malformed or does not fit the model.

    ``path`` is the key path inside the plan (``bits.rules[2].layers[0]``), ``value`` the
    offending value and ``source`` the file it came from, when known. The attributes hold
    them as given; the message shows them escaped and truncated.
    """

    def __init__(self, path: str, problem: str, value=None, source: str | None = None, show_value: bool = True):
        self.path = path
        self.problem = problem
        self.value = value
        self.source = source
        self.show_value = show_value
        where = f"{one_line(str(source), MAX_NAME_CHARS)}: " if source else ""
        got = f" (got {describe(value)})" if show_value else ""
        # a problem of the whole file (FILE_PATH) is said of the file: "plan.yaml: cannot read plan file: ..."
        key = "" if path == FILE_PATH and source else f"{one_line(str(path), MAX_NAME_CHARS)}: "
        super().__init__(f"{where}{key}{one_line(str(problem), MAX_PROBLEM_CHARS)}{got}")

    def with_source(self, source: str) -> "PlanError":
        return PlanError(self.path, self.problem, self.value, source, show_value=self.show_value)


class ModelLoadError(KVPlanError):
    """The model named by the user cannot be loaded (missing package, file, or architecture)."""


class CacheError(KVPlanError, RuntimeError):
    """The quantized cache was asked to do something it cannot do correctly."""


class StorageError(KVPlanError):
    """The study storage named by the user (``--storage``) cannot be opened: its driver is
    missing, the URL is malformed, the server is unreachable or the file cannot be created."""


MAX_SEED = 2**32 - 1  # the largest seed numpy's and Optuna's generators take


def check_seed(seed, where: str = "seed") -> int:
    """``seed`` if it is a whole number in ``[0, MAX_SEED]``, else a one-line :class:`KVPlanError` naming
    ``where`` (numpy and Optuna raise their own error only once the work that uses it has run)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise KVPlanError(f"{where}: must be a whole number from 0 to {MAX_SEED}, got {describe(seed)}")
    return seed
