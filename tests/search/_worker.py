"""A search worker process for the storage tests.

``python -m tests.search._worker STORAGE STUDY N [SLEEP] [WORKER]`` or with one JSON argument
``python -m tests.search._worker '{"storage": ..., "study": ..., "n": ..., ...}'`` (keys below).
Prints ``READY`` (when ``KVPLAN_TEST_GO`` names a barrier file it waits for) and at the end
``DONE <n_real_evals>`` and a ``RESULT {json}`` line.
"""

import json
import os
import sys
import time

from kvplan.search import search
from tests.search.synthetic import SyntheticScorer


class HandshakeScorer(SyntheticScorer):
    """A synthetic scorer that can hand off with another worker through files: ``announce`` is
    created each time an evaluation starts (this worker holds a trial); the first evaluation waits
    (up to ``await_timeout`` s) until ``await_file`` exists (the other worker holds one)."""

    def __init__(self, announce=None, await_file=None, await_timeout=120.0, **kw):
        super().__init__(**kw)
        self.announce, self.await_file, self.await_timeout = announce, await_file, await_timeout

    def __call__(self, plan):
        if self.announce:
            open(self.announce, "w").close()
        if self.await_file and self.calls == 0:
            deadline = time.time() + self.await_timeout
            while not os.path.exists(self.await_file) and time.time() < deadline:
                time.sleep(0.05)
        return super().__call__(plan)


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].startswith("{"):
        cfg = json.loads(sys.argv[1])
    else:
        cfg = {"storage": sys.argv[1], "study": sys.argv[2], "n": int(sys.argv[3]),
               "sleep": float(sys.argv[4]) if len(sys.argv) > 4 else 0.0,
               "worker": int(sys.argv[5]) if len(sys.argv) > 5 else None}
    go = os.environ.get("KVPLAN_TEST_GO")  # barrier: start searching only when the test says so
    if go:
        print("READY", flush=True)
        while not os.path.exists(go):
            time.sleep(0.05)
    scorer = HandshakeScorer(sleep=cfg.get("sleep", 0.0), seed=cfg.get("data_seed", 0),
                             announce=cfg.get("announce"), await_file=cfg.get("await"))
    r = search(budget="3.0", n_trials=cfg["n"], scorer=scorer, storage=cfg["storage"], study_name=cfg["study"],
               out=cfg.get("out"), progress=False, worker=cfg.get("worker"), n_candidates=4, n_local=8,
               heartbeat_interval=cfg.get("heartbeat", 10), grace_period=cfg.get("grace", 60),
               finalize=cfg.get("finalize", False), profile=cfg.get("profile", True))
    print("DONE", r.n_real_evals, flush=True)
    print("RESULT", json.dumps({"n_real_evals": r.n_real_evals, "n_profile_evals": r.n_profile_evals,
                                "finalized_by": r.finalized_by, "paths": r.paths, "pid": os.getpid(),
                                "plan_kl": r.plan.metrics["calibration"]["kl"]}), flush=True)
