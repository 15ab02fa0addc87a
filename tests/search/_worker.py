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
    scorer = SyntheticScorer(sleep=cfg.get("sleep", 0.0), seed=cfg.get("data_seed", 0))
    r = search(budget="3.0", n_trials=cfg["n"], scorer=scorer, storage=cfg["storage"], study_name=cfg["study"],
               out=cfg.get("out"), progress=False, worker=cfg.get("worker"), n_candidates=4, n_local=8,
               heartbeat_interval=cfg.get("heartbeat", 10), grace_period=cfg.get("grace", 60),
               finalize=cfg.get("finalize", False), profile=cfg.get("profile", True))
    print("DONE", r.n_real_evals, flush=True)
    print("RESULT", json.dumps({"n_real_evals": r.n_real_evals, "n_profile_evals": r.n_profile_evals,
                                "finalized_by": r.finalized_by, "paths": r.paths, "pid": os.getpid(),
                                "plan_kl": r.plan.metrics["calibration"]["kl"]}), flush=True)
