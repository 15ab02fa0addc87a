"""The tests' throwaway PostgreSQL server does not outlive a killed test run."""

import os
import signal
import socket
import subprocess
import sys
import time
from urllib.parse import urlparse

from tests.postgres import require_postgres

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_killed_test_process_leaves_no_server_running():
    """A pytest run killed by ``timeout`` (or kill -9) never runs the fixture's ``finally``: its server kept
    running, holding a port and a temporary folder, until someone stopped it by hand."""
    require_postgres()
    code = ("import sys, time\nfrom tests.postgres import postgres_server\n"
            "with postgres_server() as url:\n    print(url, flush=True)\n    time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("postgresql://"), url
        port = urlparse(url).port
        assert _accepts(port)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 60
    while _accepts(port) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _accepts(port), f"the server on port {port} outlived the killed process"
