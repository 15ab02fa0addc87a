"""Which history tokens are worth keeping exact? A probe on a fixed plan, validation KL.

    python bench/token_protection_probe.py bench/results/search-2.5bpv.yaml
        # -> bench/results/token_protection_probe.md (~3 min)

Not a kvplan feature (the protected tokens' bytes are not counted): the plan without its recent
copies (``quantizer.recent_length`` 0), each committed block of which keeps a chosen share of its
tokens exact, chosen per (batch row, KV head) at write time from what the cache sees -- the tokens'
own K (after the plan's rotations) or their position:

* ``key-outlier``: the largest max over channels of ``|k - mean| / std`` (the tokens that stretch a
  channel group's min-max range; kept out of the group: replaced by the mean before coding);
* ``key-norm`` / ``key-small-norm``: the largest / smallest key norms;
* ``newest``: the newest tokens of the block (the end of the history).

Reads go through the dequantize route (exact tokens overwrite their decoded rows). Scored by the
validation scorer of ``kvplan search`` (16 samples, 512-token history). What it showed chose what
kvplan built: ``quantizer.recent_length`` (the newest tokens) and not a heavy-hitter selection by key
statistics (``bench/results/recent_tokens.md`` measures the built feature, bytes counted).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from _stamp import stamp  # noqa: E402
from kvplan import Plan  # noqa: E402
from kvplan.plans import atomic_write_text  # noqa: E402
from kvplan.runtime import cache as cache_mod, storage  # noqa: E402
from kvplan.search.scorers import task_scorers  # noqa: E402

# (kinds protected, share of each block's tokens, selection)
ROWS = [("k", 0.02, "key-outlier"), ("v", 0.03, "key-outlier"), ("v", 0.03, "key-norm"),
        ("v", 0.03, "key-small-norm"), ("k", 0.03, "newest"), ("v", 0.03, "newest"), ("kv", 0.03, "newest"),
        ("kv", 0.06, "newest")]
MODE = {"kinds": "", "share": 0.0, "select": ""}
_encode = storage.PackedBlock.encode.__func__
_decode_base = storage.PackedBlock._decode_base
_head_range = storage.PackedBlock.head_range
_coding = cache_mod.KVPlanLayer._coding
SLOT_CODING = {"depth": 0}  # > 0 inside KVPlanLayer._coding: a committed block of the plan's slots


def _chosen(x: torch.Tensor, stored: torch.Tensor) -> torch.Tensor | None:
    """bool ``[B, h, T]``: the tokens to keep exact (``stored``: the block as it is coded, rotated)."""
    B, h, T, _ = x.shape
    k = int(round(MODE["share"] * T))
    if k == 0:
        return None
    y = stored.float()
    if MODE["select"] == "key-outlier":
        score = ((y - y.mean(2, keepdim=True)) / (y.std(2, keepdim=True) + 1e-6)).abs().amax(-1)
    elif MODE["select"] == "key-norm":
        score = y.norm(dim=-1)
    elif MODE["select"] == "key-small-norm":
        score = -y.norm(dim=-1)
    else:  # newest
        score = torch.arange(T, dtype=torch.float32).expand(B, h, T)
    mask = torch.zeros(B, h, T, dtype=torch.bool)
    return mask.scatter_(-1, score.topk(k, dim=-1).indices, True)


def _probe_encode(cls, x, heads, bits, axis, group_size, start, basis=None, correction_bits=4, rotation=None,
                  range_flag=None, fmt=None, feedback=None, grid_origin=0, **more):
    kind = "k" if axis == "channel" and x.shape[-1] > 8 else "v"  # (a key correction code has r <= 8 channels)
    keys_seen = x if rotation is None else rotation.forward(x.float(), start)
    mask = None
    if SLOT_CODING["depth"] and 0 < bits < 16 and kind in MODE["kinds"] and x.shape[-2] >= 16:
        mask = _chosen(x, keys_seen)  # (bits 0: a streamed head, nothing coded)
    if mask is None:  # as kvplan codes it; so are the residual stores' blocks (recent / streamed-head copies)
        return _encode(cls, x, heads, bits, axis, group_size, start, basis, correction_bits, rotation, range_flag, fmt,
                       feedback, grid_origin=grid_origin, **more)
    coded = x
    if axis == "channel":  # out of its channel groups: the mean of the others stands in
        keep = (~mask).unsqueeze(-1).to(x.dtype)
        mean = (x * keep).sum(2, keepdim=True) / keep.sum(2, keepdim=True)
        coded = torch.where(mask.unsqueeze(-1), mean.expand_as(x), x)
    block = _encode(cls, coded, heads, bits, axis, group_size, start, None, correction_bits, rotation, range_flag,
                    fmt, feedback, grid_origin=grid_origin, **more)
    block._exact = (mask, x.clone())
    if basis is not None:  # the key correction codes what is left after the exact tokens
        err = x.float() - block._decode_base(torch.float32)
        block.correction = _encode(cls, torch.matmul(err, basis), heads, correction_bits, "channel", group_size,
                                   start, None, 4, None, range_flag, None, grid_origin=grid_origin)
        block.basis = basis
    return block


@contextlib.contextmanager
def _probe_coding(self, *args, **kwargs):
    """The cache's slot (and sink) coding: the only blocks whose tokens this probe keeps exact."""
    SLOT_CODING["depth"] += 1
    try:
        with _coding(self, *args, **kwargs):
            yield
    finally:
        SLOT_CODING["depth"] -= 1


def _probe_decode_base(self, dtype):
    y = _decode_base(self, dtype)
    exact = getattr(self, "_exact", None)
    return y if exact is None else torch.where(exact[0].unsqueeze(-1), exact[1].to(y.dtype), y)


def _probe_head_range(self, i0, i1):
    part = _head_range(self, i0, i1)
    exact = getattr(self, "_exact", None)
    if exact is not None:
        part._exact = (exact[0][:, i0:i1], exact[1][:, i0:i1])
    return part


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "token_protection_probe.md"))
    ap.add_argument("--samples", type=int, default=16, help="validation samples (default 16, the recorded table's; "
                    "fewer for a quick check)")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("KVPLAN_THREADS", "1")))
    storage.PackedBlock.encode = classmethod(_probe_encode)
    storage.PackedBlock._decode_base = _probe_decode_base
    storage.PackedBlock.head_range = _probe_head_range
    cache_mod.KVPlanLayer._coding = _probe_coding
    t0 = time.time()
    plan = Plan.from_yaml(args.plan)
    plan = plan.replace(quantizer=dataclasses.replace(plan.quantizer, recent_length=0))  # its slots alone
    val = task_scorers(n_calibration=1, n_validation=args.samples, n_test=0, progress=False,
                       attention="dequantize").validation
    lines = ["# Token protection probe: validation KL of a fixed plan with some tokens exact", "",
             f"Command: {stamp()} (method in the script's docstring; the exact tokens' bytes are not counted).", "",
             "| kinds kept exact | share of each block | selection | validation KL [95% CI] |", "|---|---:|---|---|"]
    for kinds, share, select in [("-", 0.0, "-")] + ROWS:
        MODE.update(kinds=kinds, share=share, select=select)
        m = val(plan)
        ci = f"[{m['kl_ci95_lo']:.4f}, {m['kl_ci95_hi']:.4f}]"
        lines.append(f"| {kinds} | {share:g} | {select} | {m['kl']:.4f} {ci} |")
        print(lines[-1], flush=True)
    lines += ["", f"Wall time {time.time() - t0:.0f} s."]
    atomic_write_text(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
