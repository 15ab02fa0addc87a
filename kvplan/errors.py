"""Exceptions a user can reach. Each names what is wrong and where."""

from __future__ import annotations


class KVPlanError(Exception):
    """Base class of kvplan's user-facing errors (the CLI prints them on one line, exit 2)."""


class PlanError(KVPlanError, ValueError):
    """A plan is malformed or does not fit the model.

    ``path`` is the key path inside the plan (``bits.rules[2].layers[0]``), ``value`` the
    offending value and ``source`` the file it came from, when known.
    """

    def __init__(self, path: str, problem: str, value=None, source: str | None = None, show_value: bool = True):
        self.path = path
        self.problem = problem
        self.value = value
        self.source = source
        where = f"{source}: " if source else ""
        got = f" (got {value!r})" if show_value else ""
        super().__init__(f"{where}{path}: {problem}{got}")

    def with_source(self, source: str) -> "PlanError":
        return PlanError(self.path, self.problem, self.value, source, show_value=self._show_value())

    def _show_value(self) -> bool:
        return str(self).endswith(f"(got {self.value!r})")


class ModelLoadError(KVPlanError):
    """The model named by the user cannot be loaded (missing package, file, or architecture)."""


class CacheError(KVPlanError, RuntimeError):
    """The quantized cache was asked to do something it cannot do correctly."""
