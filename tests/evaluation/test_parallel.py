"""Sample-parallel evaluation (kvplan.evaluation.parallel): same numbers as the serial loop."""

import multiprocessing as mp
import os
import signal

import pytest
import torch

from kvplan.errors import KVPlanError
from kvplan.evaluation import ProtocolError, Sample, evaluate, prepare_samples
from kvplan.evaluation.parallel import SampleProcesses, shares, usable_processes
from kvplan.models.geometry import Geometry
from kvplan.plans.baselines import uniform_plan
from tests.tiny_models import tiny_llama

pytestmark = pytest.mark.skipif("fork" not in mp.get_all_start_methods(), reason="needs the fork start method")


def test_shares_balance_cost_and_keep_order():
    assert shares([10, 10, 10, 10], 2) == [[0, 2], [1, 3]]
    # the longest sample alone, the three short ones together
    assert shares([5, 30, 10, 10], 2) == [[1], [0, 2, 3]]
    assert shares([7], 3) == [[0], [], []]
    assert usable_processes(n_samples=1) == 1


@pytest.fixture(scope="module")
def tiny():
    model = tiny_llama(num_layers=3, num_kv_heads=2, head_dim=16)
    g = torch.Generator().manual_seed(0)
    samples = []
    for i, n in enumerate([96, 80, 112, 70, 96]):
        ids = torch.randint(5, model.config.vocab_size, (n + 8,), generator=g).tolist()
        samples.append(Sample(ids[:n], ["text"] * n, ids[n:], meta={"id": f"s{i}"}))
    return model, prepare_samples(model, samples, progress=False)


def _plan(model, bits=2, residual=0):
    return uniform_plan(Geometry.of(model), bits, group_size=32, residual_length=residual)


def test_processes_give_the_serial_numbers_exactly(tiny):
    model, prepared = tiny
    plan, other = _plan(model), _plan(model, bits=4)
    serial = evaluate(model, plan, prepared, progress=False)
    pool = SampleProcesses(model, prepared, 2)
    try:
        assert evaluate(model, plan, prepared, progress=False, processes=pool) == serial
        # the worker stays up between plans
        pid = pool._procs[0].pid
        assert evaluate(model, other, prepared, progress=False, processes=pool) == \
            evaluate(model, other, prepared, progress=False)
        assert [p.pid for p in pool._procs] == [pid]
    finally:
        pool.close()
    # three processes (uneven shares), made and stopped for one call
    assert evaluate(model, plan, prepared, progress=False, processes=3) == serial


def test_a_workers_error_is_raised_in_the_caller(tiny):
    model, prepared = tiny
    two = [prepared[2], prepared[1]]  # 112 and 80 history tokens: the shorter one is the worker's
    pool = SampleProcesses(model, two, 2)
    assert pool.shares == [[0], [1]]
    plan = _plan(model, residual=80)  # leaves nothing of the 80-token history quantized
    try:
        with pytest.raises(ProtocolError, match=r"sample s1: condition meant to quantize keys"):
            evaluate(model, plan, two, progress=False, expect_quantized=[("k", "text")], processes=pool)
        # the pool still works afterwards
        good = _plan(model)
        assert evaluate(model, good, two, progress=False, processes=pool) == evaluate(model, good, two, progress=False)
    finally:
        pool.close()


def test_a_dead_worker_is_a_clear_error(tiny):
    model, prepared = tiny
    pool = SampleProcesses(model, prepared, 2)
    plan = _plan(model)
    evaluate(model, plan, prepared, progress=False, processes=pool)
    os.kill(pool._procs[0].pid, signal.SIGKILL)
    pool._procs[0].join()
    with pytest.raises(KVPlanError, match=r"sample worker process \(pid \d+\) died .*exit code -9"):
        evaluate(model, plan, prepared, progress=False, processes=pool)
    # started again on the next call
    assert evaluate(model, plan, prepared, progress=False, processes=pool)["kl"]
    pool.close()


def test_a_pool_for_other_samples_is_refused(tiny):
    model, prepared = tiny
    pool = SampleProcesses(model, prepared[:2], 2)
    with pytest.raises(ValueError, match="other prepared samples"):
        evaluate(model, _plan(model), prepared, progress=False, processes=pool)
    with pytest.raises(KVPlanError, match="processes: must be a positive integer"):
        SampleProcesses(model, prepared, 0)


ORPHAN = """
import os, signal, sys, torch
from kvplan.evaluation import Sample, evaluate, prepare_samples
from kvplan.evaluation.parallel import SampleProcesses
from kvplan.models.geometry import Geometry
from kvplan.plans.baselines import uniform_plan
from tests.tiny_models import tiny_llama
model = tiny_llama()
ids = list(range(5, 105))
prepared = prepare_samples(model, [Sample(ids[:96], ["text"] * 96, ids[96:]) for _ in range(2)], progress=False)
pool = SampleProcesses(model, prepared, 2)
evaluate(model, uniform_plan(Geometry.of(model), 2, group_size=32, residual_length=0), prepared, progress=False,
         processes=pool)
print(pool._procs[0].pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_workers_exit_when_their_parent_is_killed():
    import subprocess
    import sys
    import time

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", ORPHAN], cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    pid = int(r.stdout.split()[0])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] == "Z":  # exited, not yet reaped by init
                    return
        except FileNotFoundError:
            return
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    pytest.fail(f"worker {pid} outlived its killed parent by 30 s")


def test_prefill_in_processes_gives_the_same_tensors(tiny):
    from kvplan.models.modality import Labelling

    model, prepared = tiny
    samples = [p.sample for p in prepared]
    lab = Labelling(lambda ids, cfg: [["text"] * ids.shape[1] for _ in range(ids.shape[0])], ("text",),
                    name="tests.all-text")  # a closure: stays in this process, is not pickled
    for s in samples:
        s.history_labels = ["text"] * len(s.history_ids)
    serial = prepare_samples(model, samples, progress=False, labelling=lab)
    forked = prepare_samples(model, samples, progress=False, labelling=lab, processes=2)
    for a, b in zip(serial, forked):
        assert b.labelling is lab and b.sample == a.sample
        assert all(torch.equal(x, y) for (ka, va), (kb, vb) in zip(a.kv, b.kv) for x, y in ((ka, kb), (va, vb)))
        assert torch.equal(a.rows, b.rows) and torch.equal(a.position_ids, b.position_ids)
        assert torch.equal(a.fp["scored"]["eval"], b.fp["scored"]["eval"]) and a.fp["nll"] == b.fp["nll"]


def test_close_stops_workers_that_a_later_pool_inherited(tiny):
    """A pool forked after another holds copies of the first pool's pipe ends: closing the first
    must still stop its workers (an explicit stop, not end-of-file), not terminate them after
    join's timeout."""
    model, prepared = tiny
    plan = _plan(model)
    first, second = SampleProcesses(model, prepared, 2), SampleProcesses(model, prepared, 2)
    try:
        evaluate(model, plan, prepared, progress=False, processes=first)
        evaluate(model, plan, prepared, progress=False, processes=second)  # forks while first's workers live
        procs = list(first._procs)
        first.close()
        assert [p.exitcode for p in procs] == [0]  # exited by themselves (terminated: -SIGTERM)
    finally:
        first.close()
        second.close()
