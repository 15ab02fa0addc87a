"""A throwaway PostgreSQL server for tests: ``initdb`` + ``pg_ctl`` in a temporary folder,
listening on a free loopback port, stopped and removed afterwards — also when the test process is killed
(``timeout``, kill -9), where no ``finally`` runs: a detached watchdog stops the server once that process is gone.

PostgreSQL refuses to run as root, so under root (CI runs as root) the server runs as
``nobody`` via ``runuser``. Without the binaries the fixture skips, except in CI
(``CI=true``), where a missing server is a failure: ``.ci/run`` installs ``postgresql-15``.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from contextlib import contextmanager

import pytest

PG_BIN = os.environ.get("KVPLAN_PG_BIN", "/usr/lib/postgresql/15/bin")
USER = "kvplan"


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def missing_reason() -> str | None:
    """Why no server can be started here, or ``None``."""
    for tool in ("initdb", "pg_ctl", "createdb"):
        if not os.access(os.path.join(PG_BIN, tool), os.X_OK):
            return f"PostgreSQL binaries not found ({PG_BIN}/{tool}); install postgresql-15"
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "the psycopg driver is not installed (pip install 'kvplan[postgres]')"
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "running as root and runuser is missing (PostgreSQL refuses to run as root)"
    return None


def require_postgres() -> None:
    """Skip the calling test when PostgreSQL is unavailable, but fail in CI."""
    why = missing_reason()
    if why is None:
        return
    if _in_ci():
        pytest.fail(f"CI must run the PostgreSQL tests: {why}")
    pytest.skip(why)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args: list[str], as_nobody: bool, **kw) -> subprocess.CompletedProcess:
    if as_nobody:
        args = ["runuser", "-u", "nobody", "--", *args]
    return subprocess.run(args, capture_output=True, text=True, timeout=120, **kw)


def _stop_when_gone(pid: int, stop: list[str], root: str) -> subprocess.Popen:
    """A detached shell that waits for process ``pid`` to end, then runs ``stop`` and removes ``root``: the
    server would otherwise outlive a killed test run (its port, its processes and its folder)."""
    script = (f"while kill -0 {pid} 2>/dev/null; do sleep 1; done; {shlex.join(stop)} >/dev/null 2>&1; "
              f"rm -rf {shlex.quote(root)}")
    return subprocess.Popen(["sh", "-c", script], start_new_session=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@contextmanager
def postgres_server(database: str = "kvplan"):
    """Start a server, create ``database``; yield its URL ``postgresql://kvplan@127.0.0.1:PORT/DB``."""
    as_nobody = os.geteuid() == 0
    root = tempfile.mkdtemp(prefix="kvplan-pg-")
    if as_nobody:
        shutil.chown(root, user="nobody")
    os.chmod(root, 0o700)
    data = os.path.join(root, "data")
    stop = [f"{PG_BIN}/pg_ctl", "-D", data, "-m", "immediate", "-w", "stop"]
    if as_nobody:
        stop = ["runuser", "-u", "nobody", "--", *stop]
    started = False
    watchdog = None
    try:
        r = _run([f"{PG_BIN}/initdb", "-D", data, "-A", "trust", "-U", USER, "--no-sync"], as_nobody)
        assert r.returncode == 0, f"initdb failed: {r.stderr[-2000:]}"
        for _ in range(5):  # the free port may be taken between the probe and the start: try another
            port = _free_port()
            opts = (f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off "
                    "-c full_page_writes=off -c max_connections=100")
            r = _run([f"{PG_BIN}/pg_ctl", "-D", data, "-o", opts, "-l", os.path.join(root, "log"), "-w", "-t", "60",
                      "start"], as_nobody)
            if r.returncode == 0:
                started = True
                break
            time.sleep(0.2)
        log = open(os.path.join(root, "log")).read()[-2000:] if os.path.exists(os.path.join(root, "log")) else ""
        assert started, f"pg_ctl start failed: {r.stderr[-1000:]} {log}"
        watchdog = _stop_when_gone(os.getpid(), stop, root)
        r = _run([f"{PG_BIN}/createdb", "-h", "127.0.0.1", "-p", str(port), "-U", USER, database], as_nobody)
        assert r.returncode == 0, f"createdb failed: {r.stderr[-2000:]}"
        yield f"postgresql://{USER}@127.0.0.1:{port}/{database}"
    finally:
        if watchdog is not None:
            os.killpg(watchdog.pid, signal.SIGKILL)  # its session: the shell and its sleep
            watchdog.wait()
        if started:
            subprocess.run(stop, capture_output=True, text=True, timeout=120)
        shutil.rmtree(root, ignore_errors=True)


def create_database(url: str, name: str) -> str:
    """Another database on the server of ``url`` (one per test keeps studies apart); its URL."""
    import psycopg

    base = url.rsplit("/", 1)[0]
    with psycopg.connect(url.replace("postgresql://", "postgresql://", 1), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return f"{base}/{name}"
