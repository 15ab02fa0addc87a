"""Heavy hitters by attention mass: are they the lever token-protection by key statistics was not?

    python bench/attention_protection_probe.py bench/results/no-stream/plan.yaml
        # -> bench/results/attention_protection_probe.md (~10 min; recorded as bench/results/search-2.5bpv.yaml
        #    at 35a527a, the same plan as no-stream/plan.yaml: the default plan before the search streamed heads)

Not a kvplan feature: the copies live in this probe's process only. First table: the protected
tokens' bytes are not paid (their cost column prices 8-bit per-token copies of K and V as the plan's
recent copies cost, without any position index). The recorded plan, as it is (its sink and
recent copies included), with a share of each (layer, KV head)'s history tokens read back as written
(the 8-bit residual read the runtime encodes from) instead of from their slot codes, chosen per
(layer, KV head) by:

* ``newest``: the newest history tokens before the plan's recent copies (more recent copies);
* ``window``: attention mass the **last 32 history queries** pay each token in the full-precision
  prefill (SnapKV's observation window: what a runtime can see when the prompt is written);
* ``oracle``: attention mass the **evaluated tokens' own queries** pay each history token in the
  full-precision run (not observable at write time: the ceiling any write-time heavy-hitter rule
  can reach); ``oracle-a2``: the same with squared probabilities (HeadQ's p_j^2 value weight).

Masses are summed over the query heads sharing the KV head. The attention sink (position 0) and the
recent copies are excluded from every selection (they are already held at 8 bits). Reads go through
the dequantize route (protected rows overwrite their decoded rows). Scored by the validation scorer
of ``kvplan search`` (16 samples, 512-token history, 32 evaluated tokens).

Second table: the copies **paid with slot bits** (3 or 5 window copies per KV head, still without a
position index): the searched plan lowered by the search's own repair (least predicted damage per bpv
first) and the best HeadGuard-style baseline of ``bench/codec_baselines.py`` rebuilt, each at 2.5 bpv
minus the copies' cost; ``uniform``: the same count in every KV head, ``layer``: each layer's copies go
to the tokens holding the largest share of their own head's window mass (concentrated heads get more),
``group``: the same number in every aligned group of the plan's group size (one per group of 128 for 4
copies at 512 tokens: what a per-group format, decided when each group commits, could hold).

Third table: how concentrated the oracle mass is per (layer, KV head), i.e. how much a per-slot count
could differ from a uniform one.

A plan that streams KV heads (e.g. today's recorded ``bench/results/search-2.5bpv.yaml``) is refused: the
copies' prices (the plan's residual bpv over its recent copies) and the repair assume no streamed heads.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from _stamp import stamp  # noqa: E402
from bench.allocation_ceiling import lowered_to, search_profile  # noqa: E402
from bench.codec_baselines import baseline_plans  # noqa: E402
from kvplan import Plan  # noqa: E402
from kvplan.evaluation import harness  # noqa: E402
from kvplan.plans import atomic_write_text  # noqa: E402
from kvplan.runtime import storage  # noqa: E402
from kvplan.search.scorers import task_scorers  # noqa: E402

WINDOW = 32
# (kinds protected, share of the history, selection)
ROWS = [("kv", 0.01, "newest"), ("kv", 0.01, "window"), ("kv", 0.01, "oracle"),
        ("kv", 0.03, "newest"), ("kv", 0.03, "window"), ("kv", 0.03, "oracle"),
        ("k", 0.03, "oracle"), ("v", 0.03, "oracle"), ("v", 0.03, "oracle-a2")]
MODE = {"kinds": "", "share": 0.0, "select": "", "alloc": "uniform", "group": 128}
CURRENT: dict = {"sample": None, "layer": None}
MASS: dict = {}  # history ids -> {selection: [L, H_kv, T] fp32}
_orig = {"encode": storage.PackedBlock.encode.__func__, "decode": storage.PackedBlock.decode,
         "decode_into": storage.PackedBlock.decode_into, "head_range": storage.PackedBlock.head_range,
         "build": harness.build_plan_cache}


def attention_masses(model, prepared, recent: int) -> dict[str, torch.Tensor]:
    """Per selection, a score ``[L, H_kv, T]`` for each history token (higher: protect first)."""
    s = prepared.sample
    T = len(s.history_ids)
    ids = torch.tensor([list(s.history_ids) + list(s.eval_ids)])
    with torch.no_grad():
        out = model(input_ids=ids, output_attentions=True, use_cache=False)
    rows = {"window": [], "oracle": [], "oracle-a2": []}
    for att in out.attentions:  # [1, Hq, N, N]
        p = att[0, :, :, :T].float()
        Hq = p.shape[0]
        H = prepared.kv[0][0].shape[1]
        rep = Hq // H
        win = p[:, T - WINDOW:T].sum(1).reshape(H, rep, T).sum(1)
        ev = p[:, T:]
        rows["window"].append(win)
        rows["oracle"].append(ev.sum(1).reshape(H, rep, T).sum(1))
        rows["oracle-a2"].append((ev ** 2).sum(1).reshape(H, rep, T).sum(1))
    masses = {k: torch.stack(v) for k, v in rows.items()}
    L, H, _ = masses["oracle"].shape
    masses["newest"] = torch.arange(T, dtype=torch.float32).expand(L, H, T).clone()
    for m in masses.values():  # the sink and the recent copies are held at 8 bits already
        m[..., 0] = -1.0
        m[..., T - recent:] = -1.0
    return masses


def _mask(n_tokens: int) -> torch.Tensor | None:
    """bool ``[H_kv, T]``: this sample's protected history tokens in the current layer: ``k`` per KV
    head (``alloc`` "uniform"), or ``k * H_kv`` for the layer, to the tokens holding the largest share
    of their own head's mass ("layer": heads whose attention is concentrated get more), or the same
    number in every aligned token group of each head ("group": ``k * G / T`` per group of ``G``)."""
    k = int(round(MODE["share"] * n_tokens))
    if k == 0 or CURRENT["sample"] is None:
        return None
    score = MASS[CURRENT["sample"]][MODE["select"]][CURRENT["layer"]]  # [H_kv, T]
    mask = torch.zeros_like(score, dtype=torch.bool)
    if MODE["alloc"] == "uniform":
        return mask.scatter_(-1, score.topk(k, dim=-1).indices, True)
    if MODE["alloc"] == "group":
        G = MODE["group"]
        per_group = k * G // n_tokens
        for g0 in range(0, n_tokens, G):
            part = score[:, g0:g0 + G]
            top = torch.zeros_like(part, dtype=torch.bool).scatter_(-1, part.topk(per_group, dim=-1).indices, True)
            mask[:, g0:g0 + G] = top & (part >= 0)  # never the sink or the recent copies
        return mask
    share = score.clamp_min(0) / score.clamp_min(0).sum(-1, keepdim=True)
    share = torch.where(score < 0, -1.0, share)  # never the sink or the recent copies
    return mask.flatten().scatter_(0, share.flatten().topk(k * score.shape[0]).indices, True).view_as(mask)


def _build(model, plan, prepared):
    cache = harness.make_cache(model, plan, torch.tensor([prepared.sample.history_ids]),
                               labelling=prepared.labelling)
    CURRENT["sample"] = tuple(prepared.sample.history_ids)
    for i, (k, v) in enumerate(prepared.kv):
        CURRENT["layer"] = i
        cache.layers[i].update(k, v)
    CURRENT["sample"] = None
    return cache


def _encode(cls, x, heads, bits, axis, group_size, start, *args, **kw):
    block = _orig["encode"](cls, x, heads, bits, axis, group_size, start, *args, **kw)
    kind = "k" if axis == "channel" and x.shape[-1] > 8 else "v"  # (a correction code has r <= 8 channels)
    if bits == 16 or kind not in MODE["kinds"] or x.shape[-2] < 64 or CURRENT["sample"] is None:
        return block
    T = len(CURRENT["sample"])
    full = _mask(T)
    if full is not None:
        mask = full[list(heads), start:start + x.shape[-2]].unsqueeze(0)  # [1, h, T_block]
        block._exact = (mask, x.clone())
    return block


def _overwrite(self, y):
    exact = getattr(self, "_exact", None)
    return y if exact is None else torch.where(exact[0].unsqueeze(-1), exact[1].to(y.dtype), y)


def _decode(self, dtype):
    return _overwrite(self, _orig["decode"](self, dtype))


def _decode_into(self, out):
    _orig["decode_into"](self, out)
    if getattr(self, "_exact", None) is not None:
        out.copy_(_overwrite(self, out))
    return out


def _head_range(self, i0, i1):
    part = _orig["head_range"](self, i0, i1)
    exact = getattr(self, "_exact", None)
    if exact is not None:
        part._exact = (exact[0][:, i0:i1], exact[1][:, i0:i1])
    return part


def concentration(masses: list[dict[str, torch.Tensor]], share: float) -> tuple[float, float, float]:
    """Share of each (layer, head)'s oracle mass its top ``share`` tokens hold: min, median, max
    over (layer, head), averaged over samples."""
    vals = []
    for m in masses:
        o = m["oracle"].clamp_min(0)
        k = int(round(share * o.shape[-1]))
        vals.append(o.topk(k, dim=-1).values.sum(-1) / o.sum(-1))
    v = torch.stack(vals).mean(0).flatten()
    return float(v.min()), float(v.median()), float(v.max())


PAID = ((3, ("uniform", "layer")), (4, ("uniform", "group")), (5, ("uniform", "layer")))


def paid_rows(searched: Plan, path: str, counts=PAID):
    """``(label, plan, copies per head, allocation)``: the searched plan and the best HeadGuard-style
    baseline at 2.5 bpv, and each lowered to pay for ``counts`` window copies per head (each count
    with its allocations)."""
    profile = search_profile(path)
    budget = searched.target_bpv
    per_copy = searched.bpv().residual / searched.quantizer.recent_length  # K and V of one token, all heads

    def headguard(b):
        return next(p for label, p in baseline_plans(searched, profile, b) if "at 3 bits" in label)

    rows = [("searched", searched, 0, "uniform"), ("HeadGuard-style (3-bit key heads)", headguard(budget), 0,
                                                   "uniform")]
    for n, allocs in counts:
        b = budget - n * per_copy
        lowered = lowered_to(searched, profile, b)
        for alloc in allocs:
            rows.append((f"searched, repaired to {b:.3f}", lowered, n, alloc))
            rows.append((f"HeadGuard-style at {b:.3f}", headguard(b), n, alloc))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "attention_protection_probe.md"))
    ap.add_argument("--samples", type=int, default=16, help="validation samples (default 16, the recorded table's; "
                    "fewer for a quick check)")
    ap.add_argument("--rows", type=int, default=None, help="score only the first N rows of the first two tables "
                    "(default: every row; fewer for a quick check)")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("KVPLAN_THREADS", "2")))
    t0 = time.time()
    plan = Plan.from_yaml(args.plan)
    if plan.streamed_heads():
        sys.exit(f"{args.plan} streams KV heads, which this probe's copy prices and repair do not model; the "
                 "recorded table was measured on a plan that streams none: bench/results/no-stream/plan.yaml")
    val = task_scorers(n_calibration=1, n_validation=args.samples, n_test=0, progress=False,
                       attention="dequantize",
                       processes=1).validation
    model = val.model
    route = model.config._attn_implementation
    model.set_attn_implementation("eager")
    for p in val.prepared:
        MASS[tuple(p.sample.history_ids)] = attention_masses(model, p, plan.quantizer.recent_length)
    model.set_attn_implementation(route)
    storage.PackedBlock.encode = classmethod(_encode)
    storage.PackedBlock.decode = _decode
    storage.PackedBlock.decode_into = _decode_into
    storage.PackedBlock.head_range = _head_range
    harness.build_plan_cache = _build
    lines = ["# Heavy hitters by attention mass: validation KL of the recorded plan with some tokens held at 8 bits",
             "", f"Command: {stamp()} (method "
             "in the script's docstring; the protected tokens' bytes are not counted by the run: the cost column "
             "is what 8-bit per-token copies of them would add, as the plan's recent copies cost).", "",
             "| kinds | share of the history | selection | cost (bpv, not paid) | validation KL [95% CI] |",
             "|---|---:|---|---:|---|"]
    samples = list(MASS.values())
    T = samples[0]["oracle"].shape[-1]
    for kinds, share, select in ([("-", 0.0, "-")] + ROWS)[:args.rows]:
        MODE.update(kinds=kinds, share=share, select=select)
        m = val(plan)
        n = int(round(share * T))
        # 8-bit copies of n tokens of each protected kind, priced as the plan's recent copies (the whole
        # residual share at 512 tokens: recent_length copies of K and V; no index bytes)
        cost = plan.bpv().residual * n / plan.quantizer.recent_length * len(kinds) / 2 if n else 0.0
        ci = f"[{m['kl_ci95_lo']:.4f}, {m['kl_ci95_hi']:.4f}]"
        lines.append(f"| {kinds} | {share:g} ({n} tokens) | {select} | {cost:.3f} | {m['kl']:.4f} {ci} |")
        print(lines[-1], flush=True)
    lines += ["", "Paid with slot bits (the plans' bits lowered by the search's repair until they fit 2.5 bpv minus the "
              "copies' cost; the HeadGuard-style baseline rebuilt at that budget by `bench/codec_baselines.py`):", "",
              "| plan | copies (kv, window) | allocation | slot bpv + copies | validation KL [95% CI] |",
              "|---|---:|---|---:|---|"]
    MODE["group"] = plan.quantizer.group_size
    for label, row_plan, n, alloc in paid_rows(plan, args.plan, PAID[:1] if args.rows else PAID)[:args.rows]:
        MODE.update(kinds="kv" if n else "-", share=n / T, select="window", alloc=alloc)
        m = val(row_plan)
        cost = row_plan.bpv().residual * n / row_plan.quantizer.recent_length if n else 0.0
        lines.append(f"| {label} | {n} per head | {alloc if n else '-'} | {row_plan.bpv().total:.4f} + {cost:.3f} | "
                     f"{m['kl']:.4f} [{m['kl_ci95_lo']:.4f}, {m['kl_ci95_hi']:.4f}] |")
        print(lines[-1], flush=True)
    lines += ["", "How concentrated the oracle attention mass is, per (layer, KV head), averaged over samples:", "",
              "| top share of tokens | min over heads | median | max |", "|---:|---:|---:|---:|"]
    for share in (0.01, 0.03, 0.1):
        lo, med, hi = concentration(samples, share)
        lines.append(f"| {share:g} | {lo:.3f} | {med:.3f} | {hi:.3f} |")
    lines += ["", f"Wall time {time.time() - t0:.0f} s."]
    atomic_write_text(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
