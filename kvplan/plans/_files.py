"""Plan file I/O: bounded, decoded reads that fail as :class:`PlanError`, atomic writes, and the checks
every command runs on its output paths before any work."""

from __future__ import annotations

import errno
import os
import re
import stat
import tempfile
import time
from typing import Mapping

from ..errors import FILE_PATH, KVPlanError, PlanError

MAX_PLAN_BYTES = 16 * 2 ** 20  # larger files are refused before they are parsed


def sidecar_paths(out) -> dict[str, str]:
    """The files of one search's output set: ``{"plan": out, "trials": <stem>.trials.csv,
    "search": <stem>.search.json}``."""
    out = os.fspath(out)
    stem = _plan_stem(out)
    return {"plan": out, "trials": stem + ".trials.csv", "search": stem + ".search.json"}


def _plan_stem(out: str) -> str:
    """``out`` without its ``.yaml`` / ``.yml`` extension: what a search's sidecars are named after."""
    return out[: -len(".yaml")] if out.endswith(".yaml") else out[: -len(".yml")] if out.endswith(".yml") else out


def journal_path(out) -> str:
    """The Optuna journal a search writing ``out`` keeps its study in when given no storage
    (``<stem>.journal``), so that an interrupted search resumes where it stopped."""
    return _plan_stem(os.fspath(out)) + ".journal"


def budget_plan_path(out, budget: float) -> str:
    """The plan file of one budget of a search over several, writing ``out``: ``<stem>-<b>bpv<ext>``
    (``.yaml`` when ``out`` has no extension); the search's sidecars stay ``out``'s own."""
    stem, ext = os.path.splitext(os.fspath(out))
    return f"{stem}-{budget:g}bpv{ext or '.yaml'}"


_BUDGET_PLAN = re.compile(r"^(?P<stem>.+)-[0-9][0-9.e+-]*bpv(?P<ext>\.[^./\\]*)$")


def plan_sidecar_paths(plan_path) -> dict[str, str]:
    """The sidecars of the search that wrote ``plan_path``: its own (:func:`sidecar_paths`), or, for
    one budget's plan of a search over several (:func:`budget_plan_path`) that has none of its own,
    the ones that search wrote beside them (``<stem>.trials.csv`` and ``<stem>.search.json``, shared by
    its plans; which run they belong to is checked by their run id)."""
    path = os.fspath(plan_path)
    own = sidecar_paths(path)
    m = _BUDGET_PLAN.match(path)
    if m is None or os.path.exists(own["trials"]) or os.path.exists(own["search"]):
        return own
    return {**sidecar_paths(m["stem"] + m["ext"]), "plan": path}


def check_writable(path, what: str, is_dir: bool, error: type[KVPlanError] = KVPlanError) -> None:
    """Raise ``error`` now, before the slow part, if ``path`` (a file, or a folder made as needed when
    ``is_dir``) cannot be written; ``what`` names it in the message (an option, e.g. ``--html``). The
    nearest existing folder is tried with a probe file, which is removed at once."""
    path = os.fspath(path)
    if not path.strip():
        raise error(f"{what}: the path is empty")
    if not is_dir and path.endswith(tuple(sep for sep in (os.sep, os.altsep) if sep)):
        raise error(f"{what} {path}: ends with a path separator, so it names a folder: give a file name")
    if os.path.exists(path) and os.path.isdir(path) != is_dir:
        raise error(f"{what} {path}: exists and is {'not ' if is_dir else ''}a directory")
    if not is_dir and _is_stream(path):  # a FIFO or device: written into, not replaced
        if not os.access(path, os.W_OK):
            raise error(f"{what} {path}: cannot write into it (permission denied)")
        return
    target = os.path.realpath(path) if os.path.islink(path) else path  # a link's target is what gets written
    parent = path if is_dir and os.path.isdir(path) else os.path.dirname(os.path.abspath(target))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    try:  # the probe answers for permissions, a file in the way and folders that take no files alike
        fd, probe = tempfile.mkstemp(prefix=".kvplan-probe.", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise error(f"{what} {path}: cannot write into {parent} ({e.strerror or e})") from None


def existing_path(value) -> str | None:
    """``value`` as a path if it names an existing file or folder (a model or task given by path), else
    ``None`` (a name such as ``smollm2-135m`` or ``default``, or an object)."""
    return os.fspath(value) if isinstance(value, (str, os.PathLike)) and os.path.exists(value) else None


def check_not_inputs(outputs: Mapping[str, object], inputs: Mapping[str, object],
                     error: type[KVPlanError] = KVPlanError) -> None:
    """Raise ``error`` before any work when a file to write is one of the run's inputs, which writing
    it would destroy. ``outputs`` / ``inputs``: ``{what it is: path}``; entries that are not paths
    (``None``, a model or task name, an object) are skipped."""
    def paths(named: Mapping[str, object]):
        return [(what, os.fspath(p)) for what, p in named.items() if isinstance(p, (str, os.PathLike))]

    read = {os.path.realpath(p): (what, p) for what, p in paths(inputs)}
    for what, p in paths(outputs):
        hit = read.get(os.path.realpath(p))
        if hit is not None:
            raise error(f"{what} {p}: is the {hit[0]} this run reads ({hit[1]}); writing it would overwrite "
                        "that input, choose another path")


def _too_large(size: int, source: str | None) -> PlanError:
    return PlanError(FILE_PATH, f"is {size / 2 ** 20:.1f} MiB; plan files may be at most "
                     f"{MAX_PLAN_BYTES // 2 ** 20} MiB", show_value=False, source=source)


def read_plan_bytes(path) -> bytes:
    """The bytes of a plan file (at most :data:`MAX_PLAN_BYTES`, checked before reading it all)."""
    source = os.fspath(path)
    try:
        with open(source, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_PLAN_BYTES:
                raise _too_large(size, source)
            data = f.read(MAX_PLAN_BYTES + 1)  # st_size is 0 for pipes and /dev files
    except PlanError:  # too large (a ValueError too, not one of open's)
        raise
    except OSError as e:
        raise PlanError(FILE_PATH, f"cannot read plan file: {e.strerror or e}", show_value=False,
                        source=source) from None
    except ValueError as e:  # a NUL in the path
        raise PlanError(FILE_PATH, f"cannot read plan file: {e}", show_value=False, source=source) from None
    if len(data) > MAX_PLAN_BYTES:
        raise _too_large(len(data), source)
    return data


def decode_plan_bytes(data: bytes, source: str | None) -> str:
    """UTF-8 text of a plan file (a leading byte order mark is dropped)."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise PlanError(FILE_PATH, f"is not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start} ({e.reason})",
                        show_value=False, source=source) from None


def check_size(text: str | bytes, source: str | None) -> None:
    """Refuse plan text (or bytes) given in memory beyond the file size limit."""
    if len(text) > MAX_PLAN_BYTES:
        raise _too_large(len(text), source)


TMP_SUFFIX = ".kvplan-tmp"
STALE_TMP_S = 60.0  # an old-style ".tmp-*" file this old is a dead writer's, not a live one's


def _tmp_name(path: str, old: bool = False) -> str:
    """``.<name>.<pid>.kvplan-tmp`` beside ``path``: the writer's pid in the name, so a later write
    can tell a dead writer's leftovers from a live writer's file; ``old``: the name the file being
    replaced keeps until its set is written (``.<name>.old.<pid>.kvplan-tmp``)."""
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.{OLD_PREFIX if old else ''}{os.getpid()}{TMP_SUFFIX}")


OLD_PREFIX = "old."


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


def clean_stale_temps(path) -> list[str]:
    """Remove the temporary files a killed writer of ``path`` left beside it (its pid is gone,
    or an old-style ``.tmp-*<name>`` older than a minute); returns what was removed."""
    folder, name = os.path.split(os.path.abspath(os.fspath(path)))
    removed = []
    try:
        entries = os.listdir(folder)
    except OSError:
        return removed
    now = time.time()
    for e in entries:
        full = os.path.join(folder, e)
        stale = False
        if e.startswith(f".{name}.") and e.endswith(TMP_SUFFIX):
            pid = e[len(name) + 2: -len(TMP_SUFFIX)].removeprefix(OLD_PREFIX)  # a new file's temp or an old one's
            stale = pid.isdigit() and (int(pid) == os.getpid() or not _pid_alive(int(pid)))
        elif e.startswith(".tmp-") and e.endswith(name):
            try:
                stale = now - os.stat(full).st_mtime > STALE_TMP_S
            except OSError:
                stale = False
        if stale:
            try:
                os.unlink(full)
                removed.append(full)
            except OSError:
                pass
    return removed


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _is_stream(path: str) -> bool:
    """Whether ``path`` exists (through links) as something other than a regular file or a folder: a FIFO, a
    device such as ``/dev/stdout``, which is written into (a rename would put a regular file in its place)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def write_file_set(files: dict) -> None:
    """Write several files (``path -> text``, or bytes) as one set: every file to a temporary name in its own folder
    (leftovers of a killed earlier write removed first) and ``fsync``-ed, and only then each
    renamed into place. A failure before the renames leaves the old set untouched, and so does a
    rename that fails (a file the system will not replace): the files already renamed are put back
    (each replaced file keeps a second name, a hard link, until the set is written). A symbolic link is written
    through (its target is replaced, the link stays); a FIFO or device (``/dev/stdout``) is written into, after
    the regular files. A kill during
    the renames (microseconds) can mix sets, which is why the search writes one ``run_id`` into every
    file of a set and ``kvplan explain`` checks it."""
    tmps: list[tuple[str, str]] = []
    olds: dict[str, str | None] = {}  # path -> the replaced file's second name ("": none made; None: no file)
    renamed: list[str] = []
    streams = {}  # a FIFO or device named as an output: written into, once the files are in place
    path = None
    try:
        for path, text in files.items():
            path = os.fspath(path)
            if _is_stream(path):
                streams[path] = text
                continue
            if os.path.islink(path):  # written through, as open() would: the link stays, its target is replaced
                path = os.path.realpath(path)
            folder = os.path.dirname(os.path.abspath(path))
            os.makedirs(folder, exist_ok=True)
            clean_stale_temps(path)
            tmp = _tmp_name(path)
            tmps.append((tmp, path))
            with (open(tmp, "wb") if isinstance(text, bytes) else open(tmp, "w", encoding="utf-8")) as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        for _, path in tmps:  # what would fail a rename, found before the first one
            if os.path.isdir(path):
                raise IsADirectoryError(21, "Is a directory", path)
            olds[path] = _second_name(path) if os.path.lexists(path) else None
        for tmp, path in tmps:
            os.replace(tmp, path)
            renamed.append(path)
        for folder in {os.path.dirname(os.path.abspath(p)) for _, p in tmps}:
            _fsync_dir(folder)
        for path, text in streams.items():
            with open(path, "wb") as f:
                f.write(text if isinstance(text, bytes) else text.encode("utf-8"))
    except BaseException as e:
        for done in reversed(renamed):  # put the old set back
            try:
                if olds[done]:
                    os.replace(olds[done], done)
                elif olds[done] is None:  # there was no file: none again ("": no way back, the new one stays)
                    os.unlink(done)
            except OSError:
                pass
        for tmp, _ in tmps:
            if os.path.exists(tmp):
                os.unlink(tmp)
        if isinstance(e, OSError):  # the file the user named, not our temporary one
            raise KVPlanError(f"{os.fspath(path)}: cannot write ({e.strerror or e})") from e
        raise
    finally:
        for old in olds.values():
            if old and os.path.lexists(old):
                os.unlink(old)


def _second_name(path: str) -> str:
    """A hard link to the existing ``path`` (what :func:`write_file_set` puts back if the set fails); ``""``
    for a symlink or other non-regular file, or where the file system has no hard links. A file the system
    will not link (an immutable one) raises, so the set fails before any rename."""
    if not os.path.isfile(path) or os.path.islink(path):
        return ""
    old = _tmp_name(path, old=True)
    if os.path.lexists(old):
        os.unlink(old)
    try:
        os.link(path, old)
    except OSError as e:
        if e.errno in (errno.EPERM, errno.EACCES):
            raise
        return ""  # no hard links here (FAT, some network file systems): renamed without a way back
    return old


def atomic_write_text(path, text: str) -> None:
    """Write ``text`` to ``path`` via a temp file in the same folder and an atomic rename."""
    write_file_set({os.fspath(path): text})
