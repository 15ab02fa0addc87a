"""Score one plan's samples in several CPU processes at once.

An evaluation is a loop over independent samples (each: write the sample's history into a
fresh plan cache, run its evaluated tokens, compare with the full-precision reference). On
CPU most of a sample's time is Python-level work of the codec and the cache (many small
tensor calls) that extra torch threads do not speed up, so the loop is split over processes
instead: :class:`SampleProcesses` forks ``processes - 1`` workers once (after the
full-precision prefill: they inherit the model and the prepared samples copy-on-write), and
for each plan the parent and every worker score their own share of the samples with **one**
torch thread each. Per-sample results do not depend on which process or how many threads
computed them (every metric is a per-sample number; tested against the serial loop), so a
search gives the same trials and plan with any ``processes``.

Fork only: on CUDA (a forked child cannot use the parent's CUDA context) or where the
platform has no ``fork`` start method, :func:`usable_processes` says 1 and the loop stays
serial.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import weakref
from typing import Any, Sequence

from ..errors import KVPlanError


def usable_processes(model=None, n_samples: int | None = None) -> int:
    """How many processes :class:`SampleProcesses` should use by default: the CPU cores this
    process may run on (capped at ``n_samples``); 1 when ``model`` is on CUDA or the platform
    cannot fork."""
    if "fork" not in mp.get_all_start_methods():
        return 1
    if model is not None:
        try:
            if next(model.parameters()).device.type != "cpu":
                return 1
        except (StopIteration, AttributeError, TypeError):
            pass
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    if n_samples is not None:
        n = min(n, n_samples)
    return max(1, n)


def check_processes(model, processes: int) -> None:
    """Refuse ``processes`` this model and platform cannot use (one line naming why)."""
    if processes < 1:
        raise KVPlanError(f"processes: must be a positive integer (got {processes})")
    if processes > 1 and "fork" not in mp.get_all_start_methods():
        raise KVPlanError(f"processes={processes}: this platform cannot fork worker processes; use processes=1")
    if processes > 1 and next(model.parameters()).device.type != "cpu":
        raise KVPlanError(f"processes={processes}: the model is on {next(model.parameters()).device}; forked "
                          "workers cannot share it (use processes=1)")


def default_processes(processes: int | None, worker: int | None) -> int | None:
    """``processes`` as given; else 1 for one of several ``worker`` processes of a shared study
    (they already run side by side), else ``None`` (:func:`usable_processes` decides)."""
    return processes if processes is not None else (1 if worker is not None else None)


def shares(lengths: Sequence[int], processes: int) -> list[list[int]]:
    """Sample indices per process, balanced by cost (``lengths``: history + evaluated tokens):
    longest first onto the least loaded process; each share keeps sample order."""
    load = [0] * processes
    out: list[list[int]] = [[] for _ in range(processes)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        p = min(range(processes), key=lambda p: (load[p], p))
        out[p].append(i)
        load[p] += lengths[i]
    return [sorted(s) for s in out]


def _score_share(model, plan, prepared, indices, attention, expect, prefix_key) -> list[dict[str, Any]]:
    from ..runtime.load import attention_route
    from .harness import evaluate_plan_sample

    with attention_route(model, attention, plan):
        return [evaluate_plan_sample(model, plan, prepared[i], expect, prefix_key) for i in indices]


def _child_start() -> None:
    """First thing in a forked child: Ctrl-C is the parent's to handle, SIGTERM (the parent's
    ``terminate()``) ends the child as by default, not through the handler the CLI installs
    (``kvplan.cli``), and one torch thread, set before any OpenMP region (the parent's thread pool
    did not survive the fork)."""
    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    torch.set_num_threads(1)


def _run(fn, *args) -> tuple[str, Any]:
    """``("ok", fn(*args))``, or ``("error", exception)`` -- reduced to a picklable
    :class:`KVPlanError` with the same text when the exception itself cannot be pickled."""
    try:
        return "ok", fn(*args)
    except BaseException as e:  # noqa: BLE001 -- every failure goes back to the parent
        try:
            pickle.dumps(e)
            return "error", e
        except Exception:  # noqa: BLE001
            return "error", KVPlanError(f"{type(e).__name__}: {e}")


def _worker(conn, model, prepared, indices, parent_ends) -> None:
    """Child loop: receive ``(plan, attention, expect, prefix_key)``, send back the share's per-sample results
    (or the exception). Ends at the parent's stop (``None``), or when it closes its end of the pipe or dies."""
    _child_start()
    for c in parent_ends:  # inherited by fork; only the parent may hold them
        c.close()
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:  # the parent's stop
            return
        plan, attention, expect, prefix_key = msg
        try:
            conn.send(_run(_score_share, model, plan, prepared, indices, attention, expect, prefix_key))
        except (BrokenPipeError, OSError):
            return


def _map_child(conn, fn, items, indices) -> None:
    """One-shot child of :func:`map_forked`: its share's results, pickled, then exit."""
    _child_start()
    try:
        conn.send_bytes(pickle.dumps(_run(lambda: [fn(items[i]) for i in indices])))
    except OSError:
        pass
    conn.close()


def map_forked(fn, items: Sequence, processes: int, costs: Sequence[int] | None = None) -> list:
    """``[fn(x) for x in items]``, computed by this process and ``processes - 1`` forked children
    at once, one torch thread each (``costs``: relative cost of each item, for balancing).
    The children inherit ``fn`` and ``items`` (no pickling on the way in); results come back
    pickled, so they must be picklable. An exception of ``fn`` is raised here."""
    import torch

    processes = max(1, min(processes, len(items)))
    if processes == 1:
        return [fn(x) for x in items]
    parts = shares(list(costs) if costs is not None else [1] * len(items), processes)
    ctx = mp.get_context("fork")
    conns, procs = [], []
    for indices in parts[1:]:
        parent_end, child_end = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_map_child, args=(child_end, fn, items, indices), daemon=True, name="kvplan-map")
        p.start()
        child_end.close()
        conns.append(parent_end)
        procs.append(p)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    results: list = [None] * len(items)
    try:
        for i in parts[0]:
            results[i] = fn(items[i])
        error = None
        for c, p, indices in zip(conns, procs, parts[1:]):
            try:
                status, payload = pickle.loads(c.recv_bytes())
            except (EOFError, OSError):
                p.join(timeout=1)
                raise KVPlanError(f"a worker process (pid {p.pid}) died (exit code {p.exitcode})") from None
            if status == "error":
                error = error or payload
                continue
            for i, r in zip(indices, payload):
                results[i] = r
    finally:
        torch.set_num_threads(threads)
        for p in procs:
            if p.is_alive():
                p.terminate()
        _stop(conns, procs)
    if error is not None:
        raise error
    return results


def _stop(conns, procs) -> None:
    for c in conns:
        # an explicit stop: a worker forked later (by another SampleProcesses) still holds a copy of
        # this end, so closing it alone would not give the worker end-of-file
        if c.writable:
            try:
                c.send(None)
            except (BrokenPipeError, OSError):
                pass
        c.close()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.terminate()
            p.join()


class SampleProcesses:
    """``processes`` processes (this one and ``processes - 1`` forked workers) that score a
    plan's ``prepared`` samples together; see the module docstring. Workers start at the
    first :meth:`evaluate_samples` and stop at :meth:`close` or when this object is collected."""

    def __init__(self, model, prepared: Sequence, processes: int):
        check_processes(model, processes)
        self.model = model
        self.prepared = list(prepared)
        self.processes = min(processes, max(1, len(self.prepared)))
        lengths = [p.history_len + int(p.rows.numel()) for p in self.prepared]
        self.shares = shares(lengths, self.processes)
        self._conns: list = []
        self._procs: list = []
        self._finalizer = None

    def _start(self) -> None:
        ctx = mp.get_context("fork")
        for indices in self.shares[1:]:
            parent_end, child_end = ctx.Pipe()
            # the child closes the parent ends it inherits (its own and earlier workers'), so that it
            # sees end-of-file when this process closes them or dies
            p = ctx.Process(target=_worker, args=(child_end, self.model, self.prepared, indices,
                                                  [*self._conns, parent_end]), daemon=True, name="kvplan-samples")
            p.start()
            child_end.close()
            self._conns.append(parent_end)
            self._procs.append(p)
        self._finalizer = weakref.finalize(self, _stop, self._conns, self._procs)

    def evaluate_samples(self, plan, attention: str, expect=None, prefix_key: str | None = None
                         ) -> list[dict[str, Any]]:
        """``evaluate_plan_sample`` of every prepared sample (in sample order), computed in the
        processes at once; a worker's exception is raised here. Each process keeps the recorded
        full-precision layers of its own share (``prefix_key``, see :mod:`kvplan.evaluation.prefix`)."""
        import torch

        if self.processes == 1:
            return _score_share(self.model, plan, self.prepared, self.shares[0], attention, expect, prefix_key)
        if not self._procs:
            self._start()
        for c, p in zip(self._conns, self._procs):
            try:
                c.send((plan, attention, expect, prefix_key))
            except (BrokenPipeError, OSError):
                raise self._died(p, plan) from None
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        results: list[Any] = [None] * len(self.prepared)
        error = None
        try:
            for i, r in zip(self.shares[0], _score_share(self.model, plan, self.prepared, self.shares[0],
                                                         attention, expect, prefix_key)):
                results[i] = r
            for c, p, indices in zip(self._conns, self._procs, self.shares[1:]):
                try:
                    status, payload = c.recv()
                except (EOFError, OSError):
                    raise self._died(p, plan) from None
                if status == "error":
                    error = error or payload
                    continue
                for i, r in zip(indices, payload):
                    results[i] = r
        except BaseException:
            # this process failed or was interrupted (Ctrl-C): the workers' answers would be read by
            # the next plan, so stop them now (the next evaluation starts them again)
            self.close(wait=False)
            raise
        finally:
            torch.set_num_threads(threads)
        if error is not None:
            raise error
        return results

    def _died(self, proc, plan) -> KVPlanError:
        """Stop every worker (the next evaluation starts them again) and say which one died."""
        proc.join(timeout=1)
        code = proc.exitcode
        self.close(wait=False)
        return KVPlanError(f"a sample worker process (pid {proc.pid}) died while scoring plan "
                           f"{getattr(plan, 'name', None) or '<unnamed>'} (exit code {code})")

    def close(self, wait: bool = True) -> None:
        """Stop the worker processes (idempotent; ``wait=False``: terminate them at once); the next
        evaluation starts them again."""
        if self._finalizer is not None:
            if not wait:
                for p in self._procs:
                    p.terminate()
            self._finalizer()
        self._conns, self._procs, self._finalizer = [], [], None
