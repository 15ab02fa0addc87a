"""A search worker process for the storage tests: ``python -m tests.search._worker STORAGE STUDY N [SLEEP] [WORKER]``."""

import os
import sys
import time

from kvplan.search import search
from tests.search.synthetic import SyntheticScorer

if __name__ == "__main__":
    storage, study, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    sleep = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    worker = int(sys.argv[5]) if len(sys.argv) > 5 else None
    go = os.environ.get("KVPLAN_TEST_GO")  # barrier: start searching only when the test says so
    if go:
        print("READY", flush=True)
        while not os.path.exists(go):
            time.sleep(0.05)
    r = search(budget="3.0", n_trials=n, scorer=SyntheticScorer(sleep=sleep), storage=storage, study_name=study,
               out=None, progress=False, worker=worker, n_candidates=4, n_local=8)
    print("DONE", r.n_real_evals, flush=True)
