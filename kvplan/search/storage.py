"""Where a study lives: in memory (default), an Optuna journal file, or an RDB URL.

- ``None``                            in memory (one process);
- ``"runs/s.journal"`` / ``".log"``   ``JournalStorage(JournalFileBackend(path))``: several
  processes on one machine/NFS share it with file locks; about 5x faster than SQLite per trial;
- ``"sqlite:///s.db"``, any RDB URL   ``RDBStorage`` (SQLAlchemy URL).

Workers search one study by passing the same ``storage`` and ``study_name``. A killed
search resumes from the same storage: finished trials are kept; trials this host's dead
processes left RUNNING are marked FAIL (:func:`fail_orphaned_trials`).
"""

from __future__ import annotations

import os
import random
import socket
import time

import optuna
from optuna.trial import TrialState

from ..errors import KVPlanError

JOURNAL_SUFFIXES = (".journal", ".log", ".jsonl")


def make_storage(storage):
    """An Optuna storage object (or ``None`` for in-memory) from a path / URL / storage."""
    if storage is None or not isinstance(storage, (str, os.PathLike)):
        return storage
    s = os.fspath(storage)
    if "://" in s:
        if s.startswith("sqlite:///"):
            folder = os.path.dirname(os.path.abspath(s[len("sqlite:///"):]))
            os.makedirs(folder, exist_ok=True)
        kwargs = {"connect_args": {"timeout": 60}} if s.startswith("sqlite") else None
        for attempt in range(8):
            try:
                return optuna.storages.RDBStorage(s, engine_kwargs=kwargs)
            except Exception:
                # several workers creating a fresh database race on its schema/version rows: retry
                if attempt == 7:
                    raise
                time.sleep(0.2 + 0.3 * random.random())
    if s.endswith(JOURNAL_SUFFIXES):
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        folder = os.path.dirname(os.path.abspath(s))
        os.makedirs(folder, exist_ok=True)
        return JournalStorage(JournalFileBackend(s))
    raise KVPlanError(f"storage {s!r}: use an RDB URL (sqlite:///study.db, postgresql://...) or a journal file path "
                      f"ending in {', '.join(JOURNAL_SUFFIXES)}")


def is_persistent(storage) -> bool:
    return storage is not None


HOST = socket.gethostname()


def owner_attrs() -> dict:
    return {"kvplan.host": HOST, "kvplan.pid": os.getpid()}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# A live worker records its owner attributes right after ``ask``; a RUNNING trial still
# without them after this long was asked by a process killed in between.
UNOWNED_GRACE_S = 2.0


def fail_orphaned_trials(study: optuna.Study) -> int:
    """Mark FAIL the RUNNING trials whose owning process (on this host) is gone, and those
    killed before they recorded an owner; returns how many."""
    import datetime

    n = 0
    now = datetime.datetime.now()
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        host, pid = t.user_attrs.get("kvplan.host"), t.user_attrs.get("kvplan.pid")
        unowned = host is None and t.datetime_start is not None and (
            (now - t.datetime_start).total_seconds() > UNOWNED_GRACE_S)
        dead = host == HOST and isinstance(pid, int) and pid != os.getpid() and not _alive(pid)
        if unowned or dead:
            try:
                study.tell(t.number, state=TrialState.FAIL)
                n += 1
            except Exception:  # another worker got there first
                pass
    return n
