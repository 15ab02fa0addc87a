"""Where a study lives: in memory (default), an Optuna journal file, or an RDB URL.

- ``None``                            in memory (one process);
- ``"runs/s.journal"`` / ``".log"``   ``JournalStorage(JournalFileBackend(path))``: several
  processes on one machine (or one NFS folder) share it with file locks; about 5x faster
  than SQLite per trial;
- ``"sqlite:///s.db"``, ``"postgresql://user@host:5432/db"``, any SQLAlchemy URL:
  ``RDBStorage``; PostgreSQL needs a driver (``pip install 'kvplan[postgres]'``, psycopg).

Workers search one study by passing the same ``storage`` and ``study_name``, on one machine
or several. **Failure detection.** On RDB storages each worker records an Optuna heartbeat
(``heartbeat_interval`` seconds) for every trial it holds; a RUNNING trial whose heartbeat is
older than ``grace_period`` (measured on the database server's clock, so it works across
hosts) is failed by whichever worker looks next, and :class:`RetryStale` puts an evaluation
trial back in the queue so another worker measures it. A journal file has no heartbeat in
Optuna: there each held trial carries a ``kvplan.beat`` timestamp (:class:`BeatingJournalStorage`,
same interval and grace period, by the hosts' clocks), and a trial whose owner process is gone
on this host is failed at once.

Opening a storage never retries arbitrary errors: a missing driver, a malformed URL or an
unreachable server is one :class:`StorageError` line naming ``--storage``; only the known
race of several workers creating the same fresh database schema is retried.
"""

from __future__ import annotations

import datetime
import os
import random
import re
import socket
import threading
import time
import warnings

import optuna
from optuna.trial import TrialState

from ..errors import StorageError, one_line

JOURNAL_SUFFIXES = (".journal", ".log", ".jsonl")
DEFAULT_HEARTBEAT_S = 10  # seconds between two heartbeats of a held trial (RDB storages)
DEFAULT_GRACE_S = 60  # a RUNNING trial without a heartbeat for this long is failed (and retried)

__all__ = ["DEFAULT_GRACE_S", "DEFAULT_HEARTBEAT_S", "Heartbeat", "RetryStale", "StorageError", "describe_storage",
           "fail_orphaned_trials", "hold_journal", "make_storage", "redact"]


def redact(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for error lines and sidecars)."""
    return re.sub(r"(://[^/:@]*:)[^/@]*@", r"\1***@", str(url))


_SCHEMA_RACE = ("already exists", "duplicate key", "database is locked", "uniqueviolation", "unique constraint")


def _is_schema_race(e: Exception) -> bool:
    import sqlalchemy.exc

    return isinstance(e, sqlalchemy.exc.DBAPIError) and any(s in str(e).lower() for s in _SCHEMA_RACE)


def _driver_hint(url: str) -> str:
    if url.startswith(("postgresql", "postgres")):
        return "; install a PostgreSQL driver: pip install 'kvplan[postgres]' (psycopg)"
    if url.startswith("mysql"):
        return "; install a MySQL driver (e.g. pip install pymysql and use mysql+pymysql://)"
    return ""


def _open_rdb(url: str, heartbeat_interval: int | None, grace_period: int | None):
    import sqlalchemy.exc

    label = redact(url)
    if url.startswith("postgres://"):
        raise StorageError(f"--storage {label}: SQLAlchemy needs the scheme postgresql:// (not postgres://)")
    if url.startswith("sqlite:///"):
        folder = os.path.dirname(os.path.abspath(url[len("sqlite:///"):]))
        if not os.path.isdir(folder):
            try:
                os.makedirs(folder, exist_ok=True)
            except OSError as e:
                raise StorageError(f"--storage {label}: cannot create folder {folder}: {e.strerror or e}") from None
    kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    if url.startswith("postgresql"):
        kwargs = {"connect_args": {"connect_timeout": 10}}
    hb = {}
    if heartbeat_interval:
        hb = {"heartbeat_interval": int(heartbeat_interval), "grace_period": int(grace_period or DEFAULT_GRACE_S),
              "heartbeat_stale_trial_callback": RetryStale()}
    for attempt in range(8):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return optuna.storages.RDBStorage(url, engine_kwargs=kwargs, **hb)
        except ImportError as e:
            raise StorageError(f"--storage {label}: its database driver is not installed ({e}){_driver_hint(url)}") \
                from None
        except (sqlalchemy.exc.ArgumentError, sqlalchemy.exc.NoSuchModuleError) as e:
            raise StorageError(f"--storage {label}: not a usable database URL ({one_line(str(e), 200)})") from None
        except sqlalchemy.exc.DBAPIError as e:
            if _is_schema_race(e) and attempt < 7:
                # several workers creating one fresh database race on its schema/version rows
                time.sleep(0.2 + 0.3 * random.random())
                continue
            first = str(getattr(e, "orig", None) or e).strip().splitlines()
            raise StorageError(f"--storage {label}: cannot open the database: "
                               f"{one_line(first[0] if first else type(e).__name__, 300)}") from None
    raise AssertionError("unreachable")


def check_journal_file(path, name: str = "--storage") -> None:
    """Refuse a journal path that exists but is not a regular file (a FIFO would block the reader forever,
    a device would be read without end), before any work; ``name``: how the user gave it."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        raise StorageError(f"{name} {path}: cannot open the journal file: {e.strerror or e}") from None
    if not stat.S_ISREG(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
                "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "not a regular file")
        raise StorageError(f"{name} {path}: is {kind}, not a journal file")


def hold_journal(path, name: str = "--storage"):
    """An exclusive advisory lock (``flock``) on a search's own journal (the one beside ``--out``), held for the
    search's lifetime: a second search writing the same ``--out`` at the same time is refused, where it used to
    race the first to the plan files. Returns the open file holding the lock (close it to release; the kernel
    releases it when the process ends, killed or not); ``None``, with a warning, where the file system has no
    locks (some network mounts)."""
    import fcntl

    f = open(path, "rb")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise StorageError(f"{name} {path}: another kvplan search is running with this --out (it holds the "
                           "journal); wait for it to end, or give another --out") from None
    except OSError as e:
        f.close()
        warnings.warn(f"kvplan: {name} {path}: cannot lock the journal ({e.strerror or e}); a second search with "
                      "this --out at the same time would not be refused")
        return None
    return f


def make_storage(storage, *, heartbeat_interval: int | None = DEFAULT_HEARTBEAT_S,
                 grace_period: int | None = DEFAULT_GRACE_S, name: str = "--storage"):
    """An Optuna storage object (or ``None`` for in-memory) from a path / URL / storage.

    RDB storages get Optuna's heartbeat (``heartbeat_interval`` seconds, ``None``/0: off) and
    :class:`RetryStale`. Raises :class:`StorageError` (one line, naming the storage as ``name``: the
    option the user gave it with) when it cannot be opened."""
    if storage is None or not isinstance(storage, (str, os.PathLike)):
        return storage
    s = os.fspath(storage)
    if "://" in s:
        return _open_rdb(s, heartbeat_interval, grace_period)
    if s.endswith(JOURNAL_SUFFIXES):
        from optuna.storages.journal import JournalFileBackend

        check_journal_file(s, name)
        folder = os.path.dirname(os.path.abspath(s))
        try:
            os.makedirs(folder, exist_ok=True)
            backend = JournalFileBackend(s)
            _check_journal(s, name)
            with open(s, "ab"):  # Optuna appends to an existing file only at the first write: refuse it here
                pass
            return BeatingJournalStorage(backend, heartbeat_interval, grace_period)
        except OSError as e:
            raise StorageError(f"{name} {s}: cannot open the journal file: {e.strerror or e}") from None
    raise StorageError(f"--storage {one_line(s, 200)}: use an RDB URL (sqlite:///study.db, postgresql://...) or a "
                       f"journal file path ending in {', '.join(JOURNAL_SUFFIXES)}")


from optuna.storages.journal import JournalStorage  # noqa: E402


class BeatingJournalStorage(JournalStorage):
    """A journal file storage whose workers keep their trials alive themselves: Optuna's journal
    storage has no heartbeat, so each held trial gets ``user_attrs["kvplan.beat"]`` (the
    worker's wall-clock time) every ``heartbeat_interval`` seconds, and a RUNNING trial whose
    beat is older than ``grace_period`` is failed by any worker, on any host sharing the file
    (hosts' clocks must agree to well within the grace period, as NTP keeps them)."""

    def __init__(self, backend, heartbeat_interval: int | None = DEFAULT_HEARTBEAT_S,
                 grace_period: int | None = DEFAULT_GRACE_S):
        super().__init__(backend)
        self.kvplan_heartbeat_interval = heartbeat_interval or None
        self.kvplan_grace_period = grace_period or (2 * heartbeat_interval if heartbeat_interval else None)


BEAT = "kvplan.beat"


def _journal_beat(storage) -> bool:
    return isinstance(storage, BeatingJournalStorage) and storage.kvplan_heartbeat_interval is not None


def _check_journal(path: str, name: str = "--storage") -> None:
    """Refuse a journal file with a line that is not a whole JSON record, before any work: Optuna skips
    a cut-off last line when it reads, then appends after it, and every later read of the study fails.
    A last line without its newline is a write that never finished (a full disk, a killed writer: Optuna
    writes each record whole, newline included): it is cut off the file, with a warning, as a database
    drops a torn write. Read under the lock Optuna's writers take, so a line being written is never seen
    half done."""
    import json

    from optuna.storages.journal import JournalFileSymlinkLock

    try:  # Optuna's record kinds (a private name: a later Optuna may move it, then only the shape is checked)
        from optuna.storages.journal._storage import JournalOperation

        op_codes = {int(op) for op in JournalOperation}
    except ImportError:
        op_codes = None
    lock = JournalFileSymlinkLock(path)
    lock.acquire()
    try:
        with open(path, "rb+") as f:
            start = 0  # where the line being read begins
            for number, line in enumerate(f, start=1):
                if not line.endswith(b"\n"):  # only the last line can: a write that never finished
                    f.truncate(start)
                    warnings.warn(f"kvplan: {name} {path}: dropped its last line ({len(line)} bytes without a "
                                  "newline: a record whose write never finished, e.g. on a full disk or a killed "
                                  "run); every whole record is kept", stacklevel=3)
                    break
                try:
                    record = json.loads(line)
                    op = record.get("op_code") if isinstance(record, dict) else None
                    if not isinstance(op, int) or (op_codes is not None and op not in op_codes):
                        raise ValueError("not an object with a known op_code")
                except (ValueError, RecursionError) as e:  # RecursionError: JSON nested too deep
                    raise StorageError(f"{name} {path}: line {number} is not an Optuna journal record "
                                       f"({one_line(str(e), 120)}); remove that line to resume the study") from None
                start += len(line)
    finally:
        lock.release()


def storage_file(storage) -> str | None:
    """The local file a storage (a ``--storage`` value, or what :func:`make_storage` made of it) keeps
    its study in: a journal file or a ``sqlite:///`` database; ``None`` for other storages."""
    if storage is None:
        return None
    if isinstance(storage, (str, os.PathLike)):
        s = os.fspath(storage)
    else:
        path = _journal_path(storage)
        if path:
            return path
        s = getattr(storage, "url", None)
        if not isinstance(s, str):
            return None
    if s.startswith("sqlite:///"):
        return s[len("sqlite:///"):] or None
    return None if "://" in s else s


def describe_storage(storage) -> str | None:
    """A printable name of a storage (URL with the password hidden, journal path), or ``None``."""
    if storage is None:
        return None
    if isinstance(storage, (str, os.PathLike)):
        return redact(os.fspath(storage))
    url = getattr(storage, "url", None)
    if url:
        return redact(url)
    return _journal_path(storage) or type(storage).__name__


def _journal_path(storage) -> str | None:
    """The file of a journal storage object (Optuna keeps it on the backend), else ``None``."""
    path = getattr(getattr(storage, "_backend", None), "_file_path", None)
    return str(path) if path else None


def is_persistent(storage) -> bool:
    return storage is not None


def has_heartbeat(storage) -> bool:
    from optuna.storages._heartbeat import is_heartbeat_enabled

    return storage is not None and is_heartbeat_enabled(storage)


HOST = socket.gethostname()


def owner_attrs() -> dict:
    """Who holds a trial: recorded in ``user_attrs["kvplan.owner"]`` in one write."""
    from .._version import __version__

    return {"host": HOST, "pid": os.getpid(), "kvplan_version": __version__}


def trial_owner(t) -> dict:
    o = t.user_attrs.get("kvplan.owner")
    if isinstance(o, dict):
        return o
    if "kvplan.host" in t.user_attrs:  # studies written before kvplan.owner
        return {"host": t.user_attrs.get("kvplan.host"), "pid": t.user_attrs.get("kvplan.pid")}
    return {}


# Roles of trials that are bookkeeping, not evaluations: never retried when their owner dies.
NO_RETRY_ROLES = ("profile-claim", "finalize-claim", "reservation")
# Attributes of a trial that belong to its dead owner, not to the plan it proposes.
OWNER_KEYS = ("kvplan.owner", "kvplan.eval", "kvplan.role", "kvplan.host", "kvplan.pid", "kvplan.beat")


class RetryStale:
    """Heartbeat-stale trial callback: a failed *evaluation* trial goes back to the queue
    (``WAITING``, same params, its owner's attributes dropped) so another worker measures it,
    at most ``max_retry`` times; bookkeeping trials (claims, reservations) are not retried.
    Like Optuna's ``RetryHeartbeatStaleTrialCallback``, it records ``failed_trial`` and
    ``retry_history`` in the new trial's system attrs."""

    def __init__(self, max_retry: int = 3):
        self.max_retry = max_retry

    def __call__(self, study: optuna.Study, trial) -> None:
        if trial.user_attrs.get("kvplan.role") in NO_RETRY_ROLES or not trial.params:
            return
        history = list(trial.system_attrs.get("retry_history", [])) + [trial.number]
        if len(history) > self.max_retry:
            return
        system_attrs = {k: v for k, v in trial.system_attrs.items() if k not in ("fixed_params",)}
        system_attrs.update(failed_trial=trial.system_attrs.get("failed_trial", trial.number), retry_history=history)
        study.add_trial(optuna.trial.create_trial(
            state=TrialState.WAITING, params=trial.params, distributions=trial.distributions,
            user_attrs={k: v for k, v in trial.user_attrs.items() if k not in OWNER_KEYS},
            system_attrs={**system_attrs, "fixed_params": dict(trial.params)}))


class Heartbeat:
    """Keeps the trials a worker holds alive: one background thread records a heartbeat for
    each held trial every ``interval`` seconds: Optuna's on RDB storages with heartbeat, the
    ``kvplan.beat`` attribute on a :class:`BeatingJournalStorage`; a no-op elsewhere.
    ``hold(trial_id)`` records one at once."""

    def __init__(self, storage):
        self.storage = storage
        self.journal = _journal_beat(storage)
        self.enabled = has_heartbeat(storage) or self.journal
        self.held: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if self.enabled:
            self.interval = float(storage.kvplan_heartbeat_interval if self.journal
                                  else storage.get_heartbeat_interval())
            self._thread = threading.Thread(target=self._loop, name="kvplan-heartbeat", daemon=True)
            self._thread.start()

    def _record(self, trial_id: int) -> None:
        if self.journal:
            self.storage.set_trial_user_attr(trial_id, BEAT, time.time())
        else:
            self.storage.record_heartbeat(trial_id)

    def hold(self, trial_id: int) -> None:
        if not self.enabled:
            return
        self._record(trial_id)
        with self._lock:
            self.held.add(trial_id)

    def release(self, trial_id: int) -> None:
        with self._lock:
            self.held.discard(trial_id)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                ids = sorted(self.held)
            for tid in ids:
                try:
                    self._record(tid)
                except optuna.exceptions.UpdateFinishedTrialError:
                    self.release(tid)  # told between our copy of the held set and this beat
                except Exception as e:  # a lost connection: the grace period covers a short outage
                    warnings.warn(f"kvplan: heartbeat of trial id {tid} not recorded: {one_line(str(e), 200)}")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# Without a heartbeat (journal files): a RUNNING trial still without an owner this long after
# it started was asked by a process killed before recording it (a live worker records its
# owner right after ``ask``). On heartbeat storages only trials that never got a heartbeat
# are judged this way, with the much longer grace period.
UNOWNED_GRACE_S = 30.0  # long enough for two appends to a journal on a slow NFS; such a trial holds no slot


def fail_and_requeue(study: optuna.Study, trial, retry: RetryStale) -> bool:
    """Fail the RUNNING ``trial`` and, an evaluation, put its plan back in the queue (``retry``); False
    when it is no longer running (another worker finished or failed it first)."""
    try:
        study.tell(trial.number, state=TrialState.FAIL)
    except (ValueError, RuntimeError, optuna.exceptions.UpdateFinishedTrialError):
        return False
    retry(study, study._storage.get_trial(trial._trial_id))
    return True


def fail_orphaned_trials(study: optuna.Study, grace_s: float | None = None) -> int:
    """Fail the RUNNING trials whose worker is gone and queue evaluation trials again
    (:class:`RetryStale`); returns how many were failed.

    Heartbeat storages: Optuna's ``fail_stale_trials`` (heartbeat older than the grace period,
    any host). Without a heartbeat: trials whose owner process on this host is dead. Both: a
    trial that never got an owner, after ``grace_s`` (default: the grace period, or
    :data:`UNOWNED_GRACE_S` without a heartbeat)."""
    storage = study._storage
    hb = has_heartbeat(storage)
    beat_grace = float(storage.kvplan_grace_period) if _journal_beat(storage) else None
    before = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
    if hb:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)
        rdb = getattr(storage, "_backend", storage)  # the study wraps an RDBStorage in a cache
        grace = grace_s if grace_s is not None else float(getattr(rdb, "grace_period", None)
                                                           or 2 * storage.get_heartbeat_interval())
    else:
        grace = grace_s if grace_s is not None else UNOWNED_GRACE_S
    retry = RetryStale()
    now = datetime.datetime.now()
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = trial_owner(t)
        old = t.datetime_start is not None and (now - t.datetime_start).total_seconds() > grace
        # never held: no owner (killed right after ask), or a bookkeeping trial killed before it
        # got its role (see kvplan.search._workers.add_running)
        unowned = old and (not owner or (not t.params and not t.user_attrs.get("kvplan.role")
                                         and not t.user_attrs.get("kvplan.eval")))
        pid = owner.get("pid")
        dead = (not hb and owner.get("host") == HOST and isinstance(pid, int) and pid != os.getpid()
                and not _alive(pid))
        beat = t.user_attrs.get(BEAT)
        silent = beat_grace is not None and isinstance(beat, (int, float)) and time.time() - beat > beat_grace
        if unowned or dead or silent:
            fail_and_requeue(study, t, retry)
    after = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
    return len(before - after)
