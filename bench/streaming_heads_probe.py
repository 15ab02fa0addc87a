"""Streaming KV heads (DuoAttention-style): a per-head lever the codec-only baselines do not have?

    python bench/streaming_heads_probe.py bench/results/no-stream/plan.yaml --window 16 \
        --out bench/results/streaming_heads/w16.md     # (and 32, 64; recorded as bench/results/search-2.5bpv.yaml
                                                       # at fffc82e, the same plan as no-stream/plan.yaml)

Issue 14's 0.5x target needs a lever that allocation can use and a uniform or rank-based codec
baseline cannot use as well. At 2.5 bpv almost every slot sits at its cheapest level (2 bits), so
allocation can only move the ~0.25 bpv above it. A **streaming head** (DuoAttention) keeps only
the attention sink and a window of the newest ``W`` history tokens of a KV head (K and V, 8-bit
per-token codes as the plan's recent copies) and drops the rest: at the plan's 512-token reference it
costs ``(W - recent) / 512`` of the plan's per-token copy cost instead of its two slots' codes, so
each streamed head frees ~2.2 bpv of one head pair for the others. Written before kvplan plans could
stream heads (bits 0, ``kvplan search --stream-window``), so the mask
lives in this probe's process only (an attention function wrapping SDPA that hides, for the
streamed KV heads' query heads, history positions ``sink .. T - W``), read on the dequantize route.

Steps (data hygiene: calibration chooses, validation reports; no test split is read):

1. **Profile** (calibration, 12 samples): KL of the full-precision cache with one KV head streamed,
   every (layer, KV head); the same units as the search's profile (one slot at 2 bits, the rest
   full precision), so both enter one additive damage model.
2. **Model**: the search's greedy knapsack over KV heads, each with every (key level, value level)
   of the search's slot levels plus the streaming level; predicted damage of its optimum with and
   without streaming, against the best HeadGuard-style baseline's (``bench/codec_baselines.py``) and a
   rank-based baseline that streams the heads of least streaming damage (as many as the optimum
   streams, a quarter and half of it) and spends what they free on HeadGuard's ladder (other key heads to 3
   bits in the profile's order, then value heads to 3 bits, then key heads to 4).
3. **Measured** (validation, 16 samples): the searched plan, the best HeadGuard-style baseline, the
   model's optima with and without streaming, the rank-based streaming baseline; each plan's
   streamed heads are masked and their slots read at 8 bits (the window's codes), and its honest
   bpv counts the streamed heads as the window copies only.

The searched plan must stream no KV heads (this probe streams heads with its own mask and models the plan's
slots without streaming): a plan that does (e.g. today's recorded ``bench/results/search-2.5bpv.yaml``, the
search's own streaming) is refused.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from _stamp import stamp  # noqa: E402
from bench.allocation_ceiling import plan_space, search_profile  # noqa: E402
from bench.codec_baselines import baseline_plans, key_ranking  # noqa: E402
from kvplan import Plan  # noqa: E402
from kvplan.plans import atomic_write_text, baseline_plan, slot_code  # noqa: E402
from kvplan.search import BpvModel  # noqa: E402
from kvplan.search.budget import greedy_knapsack, group_damage  # noqa: E402
from kvplan.search.scorers import task_scorers  # noqa: E402
from kvplan.search.sensitivity import correction_factor, slot_sensitivity  # noqa: E402

ATTENTION_NAME = "kvplan_streaming_probe"
STREAM: dict = {"heads": frozenset(), "window": 32, "sink": 1, "n_kv": 1}


def streaming_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA, with the streamed KV heads of this layer blind to history positions ``sink .. T - W``.

    query ``[B, Hq, Tq, D]``, key/value ``[B, H_kv or Hq, Tk, D]``; evaluated rows run against the
    history cache, so the history is the first ``Tk - Tq`` positions."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    heads = [h for layer, h in STREAM["heads"] if layer == module.layer_idx]
    B, Hq, Tq, _ = query.shape
    Tk = key.shape[-2]
    if heads and Tq < Tk:
        t_hist = Tk - Tq
        pos_q = torch.arange(Tq, device=query.device)[:, None] + t_hist
        allowed = torch.arange(Tk, device=query.device)[None, :] <= pos_q  # [Tq, Tk], causal
        allowed = allowed.expand(B, Hq, Tq, Tk).clone()
        if attention_mask is not None:
            m = attention_mask[..., :Tk]
            allowed &= m if m.dtype == torch.bool else (m == 0)
        rep = Hq // STREAM["n_kv"]
        dropped = slice(STREAM["sink"], max(STREAM["sink"], t_hist - STREAM["window"]))
        for h in heads:
            allowed[:, h * rep:(h + 1) * rep, :, dropped] = False
        attention_mask = allowed
        kwargs["is_causal"] = False
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register(model) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, streaming_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    model.set_attn_implementation(ATTENTION_NAME)


def evaluate(scorer, plan: Plan, heads=frozenset()) -> dict:
    """``scorer(plan)`` (its summary: ``kl``, ``kl_ci95_lo``...) with ``heads`` streamed."""
    STREAM["heads"] = frozenset(heads)
    try:
        return scorer(plan)
    finally:
        STREAM["heads"] = frozenset()


def head_groups(space, terms, damage: np.ndarray, stream_cost: float, stream_damage: np.ndarray):
    """Per KV head ``(layer, head)``: options ``[(cost, damage, key level, value level)]`` (level
    ``-1``: streamed), every (key, value) pair of the slots' levels plus the streaming option."""
    slot_of = {}
    for gi, g in enumerate(space.groups):
        (s,) = g.slots  # slot granularity: one slot per group
        layer, head, kind, _ = np.unravel_index(int(s), space.shape)
        slot_of[layer, head, kind] = gi
    L, H = space.geometry.num_layers, space.geometry.num_kv_heads
    groups = {}
    for layer in range(L):
        for head in range(H):
            gk, gv = slot_of[layer, head, 0], slot_of[layer, head, 1]
            opts = [(stream_cost, float(stream_damage[layer, head]), -1, -1)]
            for lk in range(space.groups[gk].n_levels):
                for lv in range(space.groups[gv].n_levels):
                    opts.append((terms.group_cost[gk, lk] + terms.group_cost[gv, lv],
                                 damage[gk, lk] + damage[gv, lv], lk, lv))
            groups[layer, head] = (gk, gv, opts)
    return groups


def knapsack_plan(space, terms, groups, budget: float, q, reference, streaming: bool):
    """The greedy knapsack's optimum over ``groups`` (head level); returns ``(table, streamed heads,
    predicted damage, honest bpv)``."""
    keys = list(groups)
    n_opt = max(len(groups[k][2]) for k in keys)
    cost = np.full((len(keys), n_opt), np.inf)
    dmg = np.full((len(keys), n_opt), np.inf)
    for i, k in enumerate(keys):
        opts = sorted(groups[k][2] if streaming else groups[k][2][1:])
        for j, o in enumerate(opts):
            cost[i, j], dmg[i, j] = o[0], o[1]
    slack = budget - terms.const - cost[:, 0].sum()
    choice = greedy_knapsack(cost, dmg, slack)
    levels = np.zeros(len(space.groups), dtype=np.int64)
    streamed = set()
    for i, k in enumerate(keys):
        gk, gv, opts = groups[k]
        opt = sorted(opts if streaming else opts[1:])[choice[i]]
        if opt[2] < 0:
            streamed.add(k)
        else:
            levels[gk], levels[gv] = opt[2], opt[3]
    table = space.table_of_levels(levels)
    total = terms.const + float(cost[np.arange(len(keys)), choice].sum())
    return table, streamed, float(dmg[np.arange(len(keys)), choice].sum()), total


def with_streamed(plan: Plan, streamed) -> Plan:
    """``plan`` with the streamed heads' K and V slots at 8 bits (the window's codes; the masked
    positions are never read)."""
    table = plan.code_table().copy()
    for layer, head in streamed:
        table[layer, head] = 8
    return plan.with_table(table)


def rank_based(searched: Plan, profile: dict, stream_damage: np.ndarray, n_stream: int, honest_bpv, budget: float):
    """A codec-only baseline given the streaming level: stream the ``n_stream`` KV heads of least
    streaming damage, then climb HeadGuard's ladder in the profile's order while the plan fits (every
    other key head to 3 bits, then every other value head to 3 bits, then key heads to 4 bits).
    Returns ``(plan, streamed heads, what was raised)``."""
    g, q = searched.geometry, searched.quantizer
    L, H = g.num_layers, g.num_kv_heads
    streamed = set(sorted(np.ndindex(L, H), key=lambda lh: stream_damage[lh])[:n_stream])
    table = np.full(searched.code_table().shape, 2, dtype=np.int64)
    table[:, :, 0, :] = slot_code(table[:, :, 0, :], bool(q.key_correction_rank))
    value_profile = {k.replace(".v", ".k"): v for k, v in profile.items() if ".v" in k}  # key_ranking reads ".k"
    ladder = ([(lh, 0, 3) for lh in key_ranking(profile, L, H)] + [(lh, 1, 3) for lh in key_ranking(value_profile, L, H)]
              + [(lh, 0, 4) for lh in key_ranking(profile, L, H)])
    raised = {}
    for (layer, head), kind, bits in ladder:
        if (layer, head) in streamed:
            continue
        trial = table.copy()
        trial[layer, head, kind, :] = bits
        if honest_bpv(searched.with_table(trial), streamed) > budget + 1e-9:
            break
        table = trial
        raised[kind, bits] = raised.get((kind, bits), 0) + 1
    what = ", ".join(f"{n} {'key' if kind == 0 else 'value'} heads at {bits} bits" for (kind, bits), n in raised.items())
    return searched.with_table(table).replace(name="rank-streaming", metrics={}), streamed, what or "nothing raised"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--window", type=int, default=32, help="history tokens a streamed head keeps (with the sink)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "streaming_heads_probe.md"))
    ap.add_argument("--calibration-samples", type=int, default=12, help="samples of the streaming profile "
                    "(default 12, the recorded tables')")
    ap.add_argument("--samples", type=int, default=16, help="validation samples (default 16, the recorded tables'; "
                    "fewer for a quick check)")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("KVPLAN_THREADS", "2")))
    t0 = time.time()
    searched = Plan.from_yaml(args.plan)
    if searched.streamed_heads():  # before the profile: its slot space (plan_space) has no streamed heads
        sys.exit(f"{args.plan} streams KV heads (kvplan's own streaming); this probe streams heads itself and "
                 "needs a plan that streams none, as the recorded tables' did: bench/results/no-stream/plan.yaml")
    profile = search_profile(args.plan)
    q = searched.quantizer
    budget = searched.target_bpv or searched.bpv().total
    scorers = task_scorers(n_calibration=args.calibration_samples, n_validation=args.samples, n_test=0,
                           progress=False, attention="dequantize",
                           processes=1)
    cal, val = scorers.calibration, scorers.validation
    model = cal.model
    g = searched.geometry
    STREAM.update(window=args.window, sink=max(1, q.sink_length), n_kv=g.num_kv_heads)
    register(model)
    full_precision = baseline_plan("fp16", g)

    # 1. streaming damage per KV head, full-precision cache otherwise (calibration)
    stream_damage = np.zeros((g.num_layers, g.num_kv_heads))
    for layer in range(g.num_layers):
        for head in range(g.num_kv_heads):
            stream_damage[layer, head] = evaluate(cal, full_precision, {(layer, head)})["kl"]
        print(f"layer {layer}: {np.round(stream_damage[layer], 5)}", flush=True)

    # 2. the damage model with a streaming level
    space = plan_space(searched)
    bpv_model = BpvModel(space, searched.reference)
    terms = bpv_model.terms(q)
    damage = group_damage(space, slot_sensitivity(space, profile), correction_factor(profile))
    per_copy = searched.bpv().residual / q.recent_length  # one token's K and V copies, every KV head
    stream_cost = max(0, args.window - q.recent_length) * per_copy / (g.num_layers * g.num_kv_heads)
    groups = head_groups(space, terms, damage, stream_cost, stream_damage)
    levels_of = space.levels_of_table

    def honest_bpv(plan: Plan, streamed) -> float:
        """The plan's bpv at its reference with the streamed heads' slots replaced by their window."""
        levels = levels_of(plan.code_table())
        total = terms.const + float(terms.group_cost[np.arange(len(levels)), levels].sum())
        assert abs(total - plan.bpv().total) < 1e-6, (total, plan.bpv().total)
        for k in streamed:
            gk, gv, _ = groups[k]
            total += stream_cost - terms.group_cost[gk, levels[gk]] - terms.group_cost[gv, levels[gv]]
        return total

    def predicted(plan: Plan, streamed) -> float:
        levels = levels_of(plan.code_table())
        return float(sum(damage[gi, lv] for gi, lv in enumerate(levels)
                         if tuple(np.unravel_index(int(space.groups[gi].slots[0]), space.shape)[:2])
                         not in streamed) + sum(stream_damage[k] for k in streamed))

    baselines = baseline_plans(searched, profile, budget)
    headguard = next(p for label, p in baselines if "at 3 bits" in label)
    rows = [("searched (kvplan search)", searched, set()),
            (next(label for label, p in baselines if "at 3 bits" in label), headguard, set())]
    for streaming in (False, True):
        table, streamed, _, _ = knapsack_plan(space, terms, groups, budget, q, searched.reference, streaming)
        plan = space.plan_of_table(table, q, searched.reference).replace(name="optimum", metrics={})
        rows.append((f"model optimum, {'with' if streaming else 'without'} streaming heads", plan, streamed))
    n_opt = len(rows[-1][2])
    for n_stream in sorted({max(1, n_opt // 4), max(1, n_opt // 2), n_opt}):
        plan, streamed, raised = rank_based(searched, profile, stream_damage, n_stream, honest_bpv, budget)
        rows.append((f"rank-based: {n_stream} least-damaged heads streamed, then {raised}", plan, streamed))

    # 3. measured on validation
    lines = [f"# Streaming KV heads at {budget:g} bpv: validation KL", "",
             f"Command: {stamp()} (method in "
             f"the script's docstring; window {args.window} history tokens + sink {STREAM['sink']}; a streamed head "
             f"costs {stream_cost:.5f} bpv of the cache instead of its two slots).", "",
             "| plan | streamed heads | honest bpv | predicted damage | validation KL [95% CI] |",
             "|---|---:|---:|---:|---|"]
    measured = []
    for label, plan, streamed in rows:
        m = evaluate(val, with_streamed(plan, streamed), streamed)
        measured.append(m["kl"])
        lines.append(f"| {label} | {len(streamed)} | {honest_bpv(plan, streamed):.4f} | {predicted(plan, streamed):.4f} "
                     f"| {m['kl']:.4f} [{m['kl_ci95_lo']:.4f}, {m['kl_ci95_hi']:.4f}] |")
        print(lines[-1], flush=True)
    best_baseline = min([measured[1]] + measured[4:])
    lines += ["", f"Searched plan / best baseline: {measured[0] / best_baseline:.2f}x; model optimum with streaming / "
              f"best baseline: {measured[3] / best_baseline:.2f}x (the best baseline: the lower of the HeadGuard-style "
              "and the rank-based streaming rows).", "",
              "Streaming damage per (layer, KV head), calibration KL with that head streamed and the rest at full "
              "precision:", "", "| layer | " + " | ".join(f"head {h}" for h in range(g.num_kv_heads)) + " |",
              "|---:|" + "---:|" * g.num_kv_heads]
    lines += [f"| {layer} | " + " | ".join(f"{stream_damage[layer, h]:.5f}" for h in range(g.num_kv_heads)) + " |"
              for layer in range(g.num_layers)]
    lines += ["", f"Wall time {time.time() - t0:.0f} s."]
    atomic_write_text(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
