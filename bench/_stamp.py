"""The stamp every bench script writes with its results: the command as run and the commit it ran at.

    from _stamp import stamp            # bench/ is on sys.path when a script runs as python bench/x.py
    lines = ["# Title", "", f"Command: {stamp()} (method in the script's docstring).", ...]

A result is only worth recording with what reproduces it: :func:`stamp` gives the Markdown
`` `python bench/x.py ARGS` at commit abc1234 ``: the arguments as typed (so no option is lost), the
command prefixed with the environment variables that change what runs (thread counts, the Triton
interpreter, kvplan's own), and the short commit the run started from (read when the script imports
this module), marked when tracked files under ``kvplan/`` or ``bench/`` differ from it.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Environment variables that change what a bench run does or how fast; recorded when set.
RECORDED_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")


def _read_commit() -> str:
    given = os.environ.get("KVPLAN_COMMIT")
    if given:
        return given
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    except OSError:  # no git installed: many scripts stamp after their measurement, which must not be lost
        head = None
    if head is None or head.returncode != 0:
        return "unknown (not a git checkout; set KVPLAN_COMMIT)"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "kvplan", "bench"],
                           cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return head.stdout.strip() + (" (+ uncommitted changes)" if dirty else "")


# read when a script imports this module, at its start: a commit made while a long run goes on is
# not the code that run loaded
_AT_START = _read_commit()


def commit() -> str:
    """The commit the run started from: HEAD's short hash when this module was imported
    (``KVPLAN_COMMIT`` when run from a copy without ``.git``), with `` (+ uncommitted changes)``
    when tracked files under ``kvplan/`` or ``bench/`` differed from it."""
    return _AT_START


def command(argv: list[str] | None = None) -> str:
    """The command line as run, from the repository root: ``[VAR=value ...] python bench/x.py ARGS``."""
    argv = sys.argv if argv is None else argv
    script = os.path.relpath(os.path.abspath(argv[0]), ROOT)
    env = [f"{k}={shlex.quote(os.environ[k])}" for k in RECORDED_ENV if k in os.environ]
    env += [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items())
            if k.startswith("KVPLAN_") and k != "KVPLAN_COMMIT"]
    return " ".join(env + ["python", shlex.quote(script)] + [shlex.quote(a) for a in argv[1:]])


def stamp(argv: list[str] | None = None) -> str:
    """`` `python bench/x.py ARGS` at commit abc1234 `` (Markdown): what reproduces a recorded result."""
    return f"`{command(argv)}` at commit {commit()}"
