"""Build and load kvplan's native CPU kernels (``kernels/native/*.c``) at first use.

The C source ships with the package; the first process that needs it compiles it with the
system C compiler (``$KVPLAN_CC``, else ``cc``) into kvplan's cache folder
(``$KVPLAN_CACHE_DIR`` or ``~/.cache/kvplan``, under ``native/``) and loads it with
:mod:`ctypes`. The file name carries a hash of the source, the flags, the compiler's version
and this CPU's instruction-set flags (the library is built with ``-march=native``), so a
changed source, compiler or machine gets its own build; concurrent first uses are safe (each
compiles to a private temporary name, then renames it into place atomically).

No compiler (or a failed build) is reported, never hidden: :func:`native_library` raises
:class:`NativeUnavailable` with the reason, and the callers that can use the chunked PyTorch
kernel instead say so once (``kvplan.load``, see :mod:`kvplan.runtime.load`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["NativeUnavailable", "native_library"]

SOURCE = Path(__file__).with_name("native") / "attention_cpu.c"
# -ffp-contract=fast: fused multiply-adds where the machine has them (as the BLAS products of the
# chunked kernel), so results differ from the reference by float rounding only; -fno-math-errno
# lets loops vectorize
CFLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fno-math-errno", "-std=c11", "-fPIC", "-shared")


class NativeUnavailable(RuntimeError):
    """The native CPU kernels cannot be built or loaded here (the message says why)."""


def _cache_dir() -> Path:
    root = os.environ.get("KVPLAN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvplan")
    return Path(root) / "native"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.machine() + platform.processor()


def _compiler() -> str:
    cc = os.environ.get("KVPLAN_CC") or "cc"
    path = shutil.which(cc)
    if path is None:
        raise NativeUnavailable(f"no C compiler: {cc!r} is not on PATH (set KVPLAN_CC to one)")
    return path


@functools.lru_cache(maxsize=1)
def native_library() -> ctypes.CDLL:
    """The compiled kernels (built on first call, then cached on disk and in the process)."""
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeUnavailable(f"the C compiler {cc} does not run: {e}") from None
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(CFLAGS).encode(), version.encode(),
                                     _cpu_flags().encode()])).hexdigest()[:20]
    folder = _cache_dir()
    target = folder / f"attention_cpu-{key}.so"
    if not target.exists():
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        except OSError as e:
            raise NativeUnavailable(f"cannot write the build folder {folder} ({e.strerror}); set KVPLAN_CACHE_DIR "
                                    "to a writable folder") from None
        os.close(fd)
        try:
            done = subprocess.run([cc, *CFLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True,
                                  timeout=300)
            if done.returncode != 0:
                raise NativeUnavailable(f"building {SOURCE.name} with {cc} failed: "
                                        f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as e:
        raise NativeUnavailable(f"loading {target} failed: {e}") from None
    i, i64, p = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    common = [i] * 5 + [p, i64, i64, i64, i, p, p, p, i64, i64, i64, i, i, i]
    lib.kvp_key_scores.argtypes = common + [p, i64, i64, i64, i, i, p, p, i64, p, p, i64, i64, i64, i, i]
    lib.kvp_key_scores.restype = None
    lib.kvp_value_accum.argtypes = common + [p, i64, i64, i64, p, i64, i64, i64, p, i]
    lib.kvp_value_accum.restype = None
    lib.kvp_feedback_codes.argtypes = [i, i64, i, i64, p, p, p, p, p, p, i, p, p]
    lib.kvp_feedback_codes.restype = None
    return lib
