"""Plan file I/O: bounded, decoded reads that fail as :class:`PlanError`, and atomic writes."""

from __future__ import annotations

import os
import tempfile

from ..errors import PlanError

MAX_PLAN_BYTES = 16 * 2 ** 20  # larger files are refused before they are parsed


def _too_large(size: int, source: str | None) -> PlanError:
    return PlanError("<file>", f"is {size / 2 ** 20:.1f} MiB; plan files may be at most {MAX_PLAN_BYTES // 2 ** 20} MiB",
                     show_value=False, source=source)


def read_plan_bytes(path) -> bytes:
    """The bytes of a plan file (at most :data:`MAX_PLAN_BYTES`, checked before reading it all)."""
    source = os.fspath(path)
    try:
        with open(source, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_PLAN_BYTES:
                raise _too_large(size, source)
            data = f.read(MAX_PLAN_BYTES + 1)  # st_size is 0 for pipes and /dev files
    except OSError as e:
        raise PlanError("<file>", f"cannot read plan file: {e.strerror or e}", show_value=False,
                        source=source) from None
    except ValueError as e:  # a NUL in the path
        raise PlanError("<file>", f"cannot read plan file: {e}", show_value=False, source=source) from None
    if len(data) > MAX_PLAN_BYTES:
        raise _too_large(len(data), source)
    return data


def decode_plan_bytes(data: bytes, source: str | None) -> str:
    """UTF-8 text of a plan file (a leading byte order mark is dropped)."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise PlanError("<file>", f"is not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start} ({e.reason})",
                        show_value=False, source=source) from None


def check_size(text: str | bytes, source: str | None) -> None:
    """Refuse plan text (or bytes) given in memory beyond the file size limit."""
    if len(text) > MAX_PLAN_BYTES:
        raise _too_large(len(text), source)


def atomic_write_text(path, text: str) -> None:
    """Write ``text`` to ``path`` via a temp file in the same folder and an atomic rename."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.basename(path), dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
