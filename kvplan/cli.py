"""The ``kvplan`` console script. Each command is a thin layer over a Python function.

Errors a user can cause (bad plan, missing model package, bad budget) print one line
``kvplan: error: ...`` and exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import errno
import signal
import sys

from .errors import MAX_SEED, KVPlanError
from .plans._checks import MAX_TOKENS


def _cmd_validate(args) -> int:
    from .plans import Plan

    plan = Plan.from_yaml(args.plan)
    if args.model:
        from .models import load_model
        from .runtime import resolve_plan

        model, _ = load_model(args.model)
        resolve_plan(args.plan, model)
    bpv = plan.bpv()
    ref = plan.reference
    print(f"{args.plan}: valid kvplan plan for {plan.geometry.model_type} "
          f"({plan.geometry.num_layers} layers x {plan.geometry.num_kv_heads} KV heads, "
          f"head_dim {plan.geometry.head_dim}); modalities {list(plan.modalities)}")
    print(f"honest bpv {bpv.total:.4f} (payload {bpv.payload:.4f}, scales/zeros {bpv.scales_zeros:.4f}, "
          f"key correction {bpv.correction:.4f}, residual {bpv.residual:.4f}) at {ref.context_len} tokens, mix {dict(ref.modality_mix)}")
    for note in plan.measurement_notes():
        print(f"{args.plan}: warning: {note}", file=sys.stderr)
    return 0


def _cmd_generate(args) -> int:
    from .runtime.demo import generate_demo

    generate_demo(args.plan, model=args.model, prompt=args.prompt, max_new_tokens=args.max_new_tokens)
    return 0


def _cmd_search(args) -> int:
    from .plans._files import journal_path
    from .search import parse_budget, search
    from .search.storage import make_storage

    budgets = args.budget if len(args.budget) > 1 else args.budget[0]
    for b in args.budget:  # an unparsable budget fails before the model loads
        parse_budget(b)
    if args.grace_period <= args.heartbeat_interval:
        raise KVPlanError(f"--grace-period {args.grace_period}: must be longer than --heartbeat-interval "
                          f"{args.heartbeat_interval}")
    if args.finalize and not (args.storage and args.study_name):
        raise KVPlanError("--finalize: needs the --storage and --study-name of the study to finalize")
    if args.worker is not None and not args.storage:
        raise KVPlanError(f"--worker {args.worker}: several workers share a study through --storage; without it "
                          "each process searches alone")
    # the storage is opened (driver, URL, server) before the model loads
    storage = make_storage(args.storage, heartbeat_interval=args.heartbeat_interval, grace_period=args.grace_period)

    extra = {}
    if args.sink_lengths is not None:
        extra["sink_lengths"] = tuple(args.sink_lengths)
    if args.recent_lengths is not None:
        extra["recent_lengths"] = tuple(args.recent_lengths)
    if args.head_profile is not None:
        if args.granularity != "slot" or args.no_profile:
            raise KVPlanError(f"--head-profile {args.head_profile}: the profile measures KV heads one by one only in "
                              "a slot-granularity search with a profile (got --granularity "
                              f"{args.granularity}{' --no-profile' if args.no_profile else ''})")
        extra["profile_head_units"] = None if args.head_profile == "all" else args.head_profile
    if args.no_profile:
        extra["profile"] = False
    if args.key_correction_rank is not None:
        extra["key_correction_rank"] = args.key_correction_rank
    if args.rotation is not None:
        extra["rotation"] = args.rotation
    if args.no_pre_rope_keys:
        extra["key_pre_rope"] = False
    for name in ("key_scaling", "value_scaling"):
        if getattr(args, name) is not None:
            extra[name] = getattr(args, name)
    if args.codebooks is not None:
        extra["codebooks"] = () if args.codebooks == "none" else tuple(args.codebooks.split(","))
    extra["residual_bits"] = args.residual_bits
    extra["sink_bits"] = args.sink_bits
    extra["heavy_length"] = args.heavy_length
    extra["stream_window"] = args.stream_window
    if args.no_error_feedback:
        extra["error_feedback"] = False

    # search() builds the task's scorers and refuses an unreachable budget before their full-precision prefills
    result = search(model=args.model, budget=budgets, granularity=args.granularity, n_trials=args.trials,
                    seed=args.seed, storage=storage, study_name=args.study_name, out=args.out, task=args.task,
                    samples=args.samples, validation_samples=args.validation_samples, test_samples=args.test_samples,
                    history_tokens=args.history_tokens, eval_tokens=args.eval_tokens, processes=args.processes,
                    context_len=args.context, pareto=args.pareto, surrogate=not args.no_surrogate,
                    worker=args.worker, progress=not args.quiet, heartbeat_interval=args.heartbeat_interval,
                    grace_period=args.grace_period, finalize=args.finalize, keep_trials=not args.no_journal,
                    **extra)
    if result.finalized_by is not None:
        by = result.finalized_by
        who = f"(host {by.get('host')}, pid {by.get('pid')}, worker {by.get('worker')})"
        if result.export == "rewritten":  # this command's earlier run: its missing files written again
            print(f"study {result.study.study_name}: measured and exported earlier {who}; its plan files were "
                  "missing here and are written again as recorded; its plans:")
        elif result.export == "in place":
            print(f"study {result.study.study_name}: measured and exported earlier {who}, by this command; its "
                  "plan files are in place, as recorded; its plans:")
        else:
            print(f"study {result.study.study_name}: finalized by another worker {who}, which wrote the plan "
                  "files; its plans:")
    for budget, plan in sorted(result.plans.items()):
        bpv = plan.bpv()
        test = plan.metrics.get("test") or {}
        kl = (f"test KL {test['kl']:.4f} [{test.get('kl_ci95_lo', float('nan')):.4f}, "
              f"{test.get('kl_ci95_hi', float('nan')):.4f}]") if "kl" in test else "no test measurement"
        where = result.paths.get(f"plan@{budget:g}", result.paths.get("plan", "(not written)"))
        ref = plan.reference
        print(f"budget {budget:g} bpv -> {where}: honest bpv {bpv.total:.4f} at {ref.context_len} tokens, "
              f"{ref.full_precision_bits}-bit full-precision storage (payload {bpv.payload:.3f}, "
              f"scales/zeros {bpv.scales_zeros:.3f}, key correction {bpv.correction:.3f}, residual "
              f"{bpv.residual:.3f}); {kl}")
    trials = f"{result.n_real_evals} real trials"
    if result.n_study_trials != result.n_real_evals:  # a resume, or other workers of a shared study
        trials += f" by this run ({result.n_study_trials} in the study)"
    if result.n_non_finite_evals:
        trials += (f" (and {result.n_non_finite_evals} measurement(s) whose KL was not finite, kept as FAILed "
                   "trials)")
    print(f"{trials} + {result.n_profile_evals} profile evaluations in {result.elapsed_s:.0f} s; trial history: "
          f"{result.paths.get('trials', '(none)')}")
    if args.storage is None and not args.no_journal and not args.finalize:
        print(f"study {result.study.study_name} kept in {journal_path(args.out)}: the same command resumes it "
              "(delete that file to start over)")
    return 0


def _cmd_explain(args) -> int:
    from .explain import explain

    print(explain(args.plan, format=args.format, out_dir=args.figures, importance=not args.no_importance,
                  context_lengths=args.context, batch_sizes=args.batch, html=args.html).rstrip("\n"))
    return 0


def _cmd_eval(args) -> int:
    from .evaluation import run_eval

    # the split is checked once the seed is known; without --samples, as many as the plan's search measured
    run_eval(args.plan, model=args.model, task=args.task, split=args.split, samples=args.samples, out=args.out,
             seed=args.seed, history_tokens=args.history_tokens, eval_tokens=args.eval_tokens, progress=not args.quiet)
    return 0


def _cmd_sweep(args) -> int:
    from .evaluation import run_sweep
    from .evaluation.runs import resolve_sample_count
    from .evaluation.tasks import check_task

    samples = resolve_sample_count(args.task, args.samples)
    seed = 0 if args.seed is None else args.seed
    check_task(args.task, {args.split: samples}, seed)
    run_sweep(model=args.model, samples=samples, out_dir=args.out_dir, task=args.task, split=args.split, seed=seed,
              **{k: v for k, v in (("history_tokens", args.history_tokens), ("eval_tokens", args.eval_tokens))
                 if v is not None}, progress=not args.quiet)
    return 0


def _int_at_least(minimum: int, maximum: int | None = None):
    """An argparse type: a whole number >= ``minimum`` (and <= ``maximum``; argparse prints the error and
    exits 2)."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if n < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {n}")
        if maximum is not None and n > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {n}")
        return n

    return parse


_positive, _non_negative = _int_at_least(1), _int_at_least(0)
_seed = _int_at_least(0, MAX_SEED)  # what numpy's and Optuna's generators take
_context_len = _int_at_least(1, MAX_TOKENS)  # what a plan's budget.reference.context_len takes


def _head_units(text: str) -> int | str:
    """``--head-profile``: a whole number >= 0, or ``all``."""
    return "all" if text == "all" else _non_negative(text)


SPLIT_CHOICES = ["calibration", "validation", "test", "heldout", "all"]


def _add_task_args(p: argparse.ArgumentParser) -> None:
    """Model and task options shared by ``eval`` and ``sweep``."""
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--task", default="default", help="'default' (offline Python docs) or a JSONL task file")
    p.add_argument("--split", default="test", choices=SPLIT_CHOICES,
                   help="which split of the task to measure on (heldout = test, its old name; all = every "
                        "record of a JSONL task)")
    p.add_argument("--samples", type=_positive, default=None,
                   help="samples of the split (default: 16 of the built-in task, every record of a JSONL task's "
                        "split, as kvplan search measures them; eval: as many as the plan's search measured)")
    p.add_argument("--history-tokens", type=_positive, default=None,
                   help="the built-in task's history length (default 512; eval: the plan's search's)")
    p.add_argument("--eval-tokens", type=_positive, default=None,
                   help="the built-in task's evaluated tokens per sample (as kvplan search --eval-tokens; default 32; "
                        "eval: the plan's search's)")
    p.add_argument("--seed", type=_seed, default=None,
                   help="how the task is split (default 0; eval: the plan's search's)")
    p.add_argument("--quiet", action="store_true")


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line like kvplan's own (``kvplan search: error: ...``)."""

    def error(self, message):
        from .errors import one_line

        self.exit(2, f"{self.prog}: error: {one_line(message, 500)} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from .search.space import (DEFAULT_FORMATS, DEFAULT_HEAVY_LENGTH, DEFAULT_RECENT_LENGTHS, DEFAULT_RESIDUAL_BITS,
                               DEFAULT_SINK_BITS, DEFAULT_TRIALS, DEFAULT_STREAM_WINDOW)
    from ._version import __version__

    p = _Parser(prog="kvplan", description="Find, explain and deploy mixed-precision KV-cache plans.")
    p.add_argument("--version", action="version", version=f"kvplan {__version__}")
    p.add_argument("--threads", type=_positive,
                   help="torch CPU threads (default: torch's choice; use 1 on a busy machine)")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("search", help="search a plan under an honest bits-per-value budget")
    s.add_argument("--budget", nargs="+", default=["2.5bpv"],
                   help="honest bits per value, e.g. 2.5bpv or 2.5; several budgets = Pareto mode, one plan each")
    s.add_argument("--model", default="smollm2-135m", help="model name, .gguf file, directory or hub id")
    s.add_argument("--granularity", default="slot", choices=["slot", "layer_kv", "layer", "kvtuner"],
                   help="slot = layer x KV head x K/V x modality; layer_kv = KVTuner space; kvtuner = its pairs")
    s.add_argument("--trials", type=_positive, default=DEFAULT_TRIALS,
                   help="real (scored) evaluations in the study, after the sensitivity profile "
                        "(337 evaluations on the default model: each (layer, K/V) unit, each KV head of each unit, "
                        "each head streamed); default %(default)s, chosen on the validation split")
    s.add_argument("--seed", type=_seed, default=0)
    s.add_argument("--task", default="default",
                   help="'default' (offline Python docs) or a JSONL task file (records: history, optional images, "
                        "question, choices, answer), split by record into calibration / validation / test")
    s.add_argument("--context", type=_context_len, default=None, metavar="N",
                   help="context length the budget is stated at (default: the calibration history length)")
    s.add_argument("--samples", type=_positive, default=None,
                   help="calibration samples, the only ones the search sees (default: 12 of the built-in task, "
                        "every calibration record of a JSONL task)")
    s.add_argument("--validation-samples", type=_non_negative, default=None,
                   help="validation samples: the final plan is the best of the best calibration trials on them "
                        "(default: 16 / every validation record; 0 = off)")
    s.add_argument("--test-samples", "--heldout-samples", dest="test_samples", type=_non_negative, default=None,
                   help="test samples for the reported measurement, never used to choose (default: 16 / every "
                        "test record; 0 = none)")
    s.add_argument("--history-tokens", type=_positive, default=None,
                   help="history length of each sample of the built-in task (default 512; a JSONL task's records "
                        "hold their own)")
    s.add_argument("--eval-tokens", type=_positive, default=None,
                   help="evaluated tokens after each history of the built-in task (default 32)")
    s.add_argument("--processes", type=_positive, default=None, metavar="N",
                   help="CPU processes scoring each candidate's samples together (default: the usable cores; 1 with "
                        "--worker or on CUDA); any N gives the same numbers")
    s.add_argument("--storage", help="Optuna storage shared by the workers of a study: a journal file path "
                   "(one machine), sqlite:///file.db, or postgresql://user@host:5432/db (several machines; "
                   "pip install 'kvplan[postgres]')")
    s.add_argument("--study-name", help="study to create, join (parallel workers) or resume")
    s.add_argument("--no-journal", action="store_true",
                   help="without --storage, keep the study in memory only: an interruption loses its trials (by "
                        "default it is kept in <out stem>.journal, and the same command run again resumes it)")
    s.add_argument("--worker", type=_non_negative, help="worker index when several processes share a study "
                   "(seeds its sampler; each worker of a study should have its own)")
    s.add_argument("--heartbeat-interval", type=_positive, default=10, metavar="S",
                   help="seconds between the heartbeats a worker records for the trials it holds (any --storage)")
    s.add_argument("--grace-period", type=_positive, default=60, metavar="S",
                   help="a trial whose worker sent no heartbeat for this long is failed and measured again by "
                        "another worker")
    s.add_argument("--finalize", action="store_true",
                   help="only pick, measure and export the final plan of an existing --storage/--study-name study")
    s.add_argument("--pareto", action="store_true", help="multi-objective search (KL vs bpv)")
    s.add_argument("--no-surrogate", action="store_true", help="score every candidate for real (ablation)")
    s.add_argument("--sink-lengths", type=int, nargs="+", default=None, metavar="N",
                   help="choices for the number of first (attention-sink) tokens kept apart from the slots "
                        "(held as --sink-bits says; default: 0 1 4)")
    s.add_argument("--no-profile", action="store_true",
                   help="skip the sensitivity profile (2 evaluations per layer before the trials): faster, "
                        "but the knapsack seed and the surrogate lose its damage prior")
    s.add_argument("--head-profile", type=_head_units, default=None, metavar="N|all",
                   help="profile the KV heads of the N most damaging (layer, K/V) units one by one "
                        "(slot granularity; default: all, chosen on the validation split; 0 = off)")
    s.add_argument("--key-correction-rank", type=_non_negative, default=None, metavar="R",
                   help="let 2-bit key slots also store a rank-R HeadQ-style correction of their error in "
                        "per-head query bases learned on the calibration samples (default: "
                        "kvplan.search.DEFAULT_KEY_CORRECTION_RANK; 0 = off)")
    s.add_argument("--rotation", choices=["none", "hadamard"], default=None,
                   help="rotate quantized K and V by a Hadamard matrix before quantizing (default: hadamard when "
                        "head_dim is a power of two)")
    s.add_argument("--no-pre-rope-keys", action="store_true",
                   help="quantize keys as the model caches them (after RoPE) instead of rotated back to the "
                        "pre-RoPE frame")
    from .kernels.formats import SCALINGS

    for kind in ("key", "value"):
        s.add_argument(f"--{kind}-scaling", choices=sorted(SCALINGS), default=None,
                       help=f"what each {kind} group stores besides its codes (default: "
                            f"{DEFAULT_FORMATS[kind + '_scaling']}; see kvplan.kernels.formats)")
    s.add_argument("--codebooks", choices=["none", "k", "v", "k,v"], default=None,
                   help="kinds coded with Lloyd-Max levels instead of uniform ones (default: "
                        f"{','.join(DEFAULT_FORMATS['codebooks']) or 'none'})")
    s.add_argument("--residual-bits", type=int, choices=[4, 8, 16], default=DEFAULT_RESIDUAL_BITS,
                   help="how plans hold the newest tokens not committed yet (the residual window and the group "
                        "still filling) and the recent copies after their first forward: 16 = as written, 8 / 4 = "
                        f"per-token codes until the group commits (default {DEFAULT_RESIDUAL_BITS}; flattens the bpv "
                        "between group boundaries)")
    s.add_argument("--sink-bits", type=int, choices=[8, 16], default=DEFAULT_SINK_BITS,
                   help="how plans hold the attention-sink tokens (--sink-lengths): 16 = as written, 8 = per-token "
                        f"codes in the slots' rotated frame (default {DEFAULT_SINK_BITS})")
    s.add_argument("--heavy-length", type=_non_negative, default=DEFAULT_HEAVY_LENGTH, metavar="N",
                   help="heavy-hitter copies per KV head of every plan: the N committed tokens a prompt's last 32 "
                        "queries attend to most keep a residual-precision copy that reads use (paid in bpv; "
                        f"default {DEFAULT_HEAVY_LENGTH})")
    s.add_argument("--stream-window", type=_non_negative, default=None, metavar="W",
                   help="let the search stream KV heads (no codes: the head attends to the sink, copies of its W "
                        "newest committed tokens and the uncommitted ones); the profile measures each head streamed "
                        "alone and the damage model picks them before the search (slot granularity; 0: off; "
                        f"default {DEFAULT_STREAM_WINDOW} where the search can stream: slot granularity, no "
                        "--heavy-length, a profile)")
    s.add_argument("--no-error-feedback", action="store_true",
                   help="round slot codes to the nearest level (default: codes chosen by error feedback under "
                        "metrics learned from the calibration queries and the output projections; same bytes)")
    s.add_argument("--recent-lengths", type=int, nargs="+", default=None, metavar="N",
                   help="choices for the number of newest committed tokens that keep a copy at the residual's "
                        "precision, read instead of their slot codes (default: "
                        f"{' '.join(map(str, DEFAULT_RECENT_LENGTHS))}; 0 = none)")
    s.add_argument("--out", default="plan.yaml", help="plan file to write (atomically); history saved beside it")
    s.add_argument("--quiet", action="store_true")
    s.set_defaults(func=_cmd_search)

    x = sub.add_parser("explain", help="why a plan looks as it does: bpv, allocation, importance")
    x.add_argument("plan")
    x.add_argument("--format", default="text", choices=["text", "json"])
    x.add_argument("--figures", metavar="DIR", help="write PNG figures into DIR (as one set)")
    x.add_argument("--html", metavar="FILE", help="write one self-contained HTML report (text, figures, provenance)")
    x.add_argument("--context", type=int, nargs="+", metavar="TOKENS",
                   help="context lengths of the memory table (default: 300 1000 1024 4096 32768 131072)")
    x.add_argument("--batch", type=int, nargs="+", metavar="N", help="batch sizes of the memory table (default: 1)")
    x.add_argument("--no-importance", action="store_true", help="skip the (slower) importance analysis")
    x.set_defaults(func=_cmd_explain)

    e = sub.add_parser("eval", help="evaluate a plan or baseline under the historical-cache protocol")
    e.add_argument("plan", help="plan file, baseline name (fp16, int8, int4, int2, k4v2[-g64]), headguard, "
                   "or a QuantizedCache peer (quanto-int4, hqq-int2)")
    _add_task_args(e)
    e.add_argument("--out", help="JSON results file")
    e.set_defaults(func=_cmd_eval)

    w = sub.add_parser("sweep", help="sensitivity landscape: {FP16, INT8, INT4, INT2} x modality x {K, V}")
    _add_task_args(w)
    w.add_argument("--out-dir", default="sweep-results")
    w.set_defaults(func=_cmd_sweep)

    v = sub.add_parser("validate", help="check a plan file (and optionally that it fits a model)")
    v.add_argument("plan", help="plan YAML file")
    v.add_argument("--model", help="also check the plan against this model (name, .gguf, dir or hub id)")
    v.set_defaults(func=_cmd_validate)

    g = sub.add_parser("generate", help="generate text on a plan's quantized cache and report its memory")
    g.add_argument("--plan", default="int4", help="plan YAML file or baseline name (default: int4)")
    g.add_argument("--model", default="smollm2-135m")
    g.add_argument("--prompt", default=None, help="default: a ~800-token Python-docs question")
    g.add_argument("--max-new-tokens", type=_positive, default=48)
    g.set_defaults(func=_cmd_generate)
    return p


def main(argv=None) -> int:
    """Run one command. A user error (any :class:`KVPlanError`) is one line ``kvplan: error: ...``
    and exit status 2; anything else is a bug in kvplan: its traceback, a line asking to
    report it, and exit status 1."""
    import os
    import traceback

    from ._version import __version__

    parser = build_parser()
    args = parser.parse_args(argv)
    previous_sigterm = _raise_on_sigterm()
    try:
        if args.threads is not None:
            import torch

            torch.set_num_threads(args.threads)
        if getattr(args, "quiet", False):  # transformers' own bars too ("Loading weights")
            from transformers.utils import logging as transformers_logging

            transformers_logging.disable_progress_bar()
        status = int(args.func(args) or 0)
        sys.stdout.flush()  # a full disk under a redirected stdout fails here, not at exit
        return status
    except KVPlanError as e:
        print(f"kvplan: error: {e}", file=sys.stderr)
        return 2
    except Terminated:
        print("kvplan: terminated (SIGTERM)", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print("kvplan: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of our output went away (kvplan explain plan.yaml | head)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 1
    except OSError as e:
        if e.errno not in ENVIRONMENT_ERRNOS:
            raise
        # the machine, not kvplan or its input: a full disk or quota, a failing or read-only device
        where = f" {e.filename}" if e.filename else ""
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        print(f"kvplan: error: cannot write{where}: {e.strerror or e} (a search keeps its finished trials in its "
              "journal; the same command resumes it once there is room)", file=sys.stderr)
        return 2
    except Exception:
        traceback.print_exc()
        print(f"kvplan: internal error: this is a bug in kvplan {__version__}, not in your input; please report it "
              "with the traceback above and the command you ran", file=sys.stderr)
        return 1
    finally:
        if previous_sigterm is not None:
            signal.signal(signal.SIGTERM, previous_sigterm)


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a scheduler's stop), raised like Ctrl-C so that a search gives its trials back and
    releases its journal lock on the way out, as it does on Ctrl-C."""


# OSError numbers main() reports as one line: the machine's state, not a bug
ENVIRONMENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS})


def _raise_on_sigterm():
    """Make SIGTERM raise :class:`Terminated` while a command runs; returns the handler to restore (``None``
    when none was installed: not the main thread, or a handler the embedding program set)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGTERM)
    if previous not in (signal.SIG_DFL, None):
        return None

    def terminate(signum, frame):
        raise Terminated()

    signal.signal(signal.SIGTERM, terminate)
    return previous


if __name__ == "__main__":
    sys.exit(main())
