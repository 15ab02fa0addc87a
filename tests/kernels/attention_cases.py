"""Shared packed-cache cases for the decode-attention kernels (Triton and chunked PyTorch),
checked against ``attention_reference.reference_decode_attention``."""

from __future__ import annotations

import torch

from kvplan.runtime.storage import PackedBlock

# (atol, rtol): values reach ~10 (outlier channels), where one fp16 / bf16 ulp is 8e-3 / 6e-2.
ATTN_TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2), torch.bfloat16: (3e-2, 2e-2)}
GROUP_SIZE = 32


def rand(shape, dtype, seed, scale=1.0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * scale
    # Some outlier channels, like real keys.
    x[..., :3] *= 8
    return x.to(dtype).to(device)


def make_cache(B, Hkv, D, dtype, segments, Tr, seed, device="cpu"):
    """segments: list of (T, [(heads, bits, axis)] for K, [(heads, bits, axis)] for V); group 32.

    Returns ``(key_blocks, value_blocks, key_residual, value_residual, T_total)``.
    """
    key_blocks, value_blocks = [], []
    start = 0
    for i, (T, kspec, vspec) in enumerate(segments):
        k = rand((B, Hkv, T, D), dtype, seed=seed + 10 * i, device=device)
        v = rand((B, Hkv, T, D), dtype, seed=seed + 10 * i + 1, scale=0.5, device=device)
        key_blocks.append([PackedBlock.encode(k[:, list(h)].contiguous(), h, bits, ax, GROUP_SIZE, start)
                           for h, bits, ax in kspec])
        value_blocks.append([PackedBlock.encode(v[:, list(h)].contiguous(), h, bits, ax, GROUP_SIZE, start)
                             for h, bits, ax in vspec])
        start += T
    kr = rand((B, Hkv, Tr, D), dtype, seed=seed + 500, device=device) if Tr else None
    vr = rand((B, Hkv, Tr, D), dtype, seed=seed + 501, device=device) if Tr else None
    return key_blocks, value_blocks, kr, vr, start + Tr


# Mixed plans: per-head-group bits, K / V groupings that differ, a 16-bit block, scattered heads
# ((0, 2) / (1, 3)), several segments (the second starts mid-group: channel start_offset 5).
PLANS = {
    "mixed-2seg": (
        4,
        [
            (37, [((0, 1), 4, "channel"), ((2, 3), 2, "channel")], [((0,), 8, "token"), ((1, 2, 3), 3, "token")]),
            (21, [((0, 2), 16, "channel"), ((1, 3), 3, "token")], [((0, 1, 2, 3), 2, "token")]),
        ],
        6,
    ),
    "int4-kivi-3seg": (
        2,
        [
            (32, [((0, 1), 4, "channel")], [((0, 1), 4, "token")]),
            (32, [((1,), 2, "channel"), ((0,), 4, "channel")], [((0,), 2, "token"), ((1,), 4, "token")]),
            (7, [((0, 1), 4, "channel")], [((0, 1), 4, "token")]),
        ],
        3,
    ),
    "residual-only": (2, [], 9),
    "one-seg-no-residual": (1, [(40, [((0,), 3, "channel")], [((0,), 2, "token")])], 0),
}

ATTN_CASES = {
    # id: (plan, dtype, n_rep, Tq, D, mask)
    "mixed-fp32-gqa3-tq2-padmask": ("mixed-2seg", torch.float32, 3, 2, 64, "pad-bool"),
    "mixed-fp16-gqa7-tq1-padmask": ("mixed-2seg", torch.float16, 7, 1, 64, "pad-bool"),
    "mixed-bf16-gqa2-tq3-floatmask": ("mixed-2seg", torch.bfloat16, 2, 3, 64, "float-per-head"),
    "kivi-fp16-D128-nomask": ("int4-kivi-3seg", torch.float16, 4, 1, 128, None),
    "kivi-fp32-D128-causal": ("int4-kivi-3seg", torch.float32, 1, 3, 128, "causal-float"),
    "residual-only-fp16": ("residual-only", torch.float16, 2, 1, 64, "pad-bool"),
    "one-seg-fp32-mha": ("one-seg-no-residual", torch.float32, 1, 1, 64, "pad-float"),
}


def mask(kind, B, Hq, Tq, T_total):
    """An attention mask ``[B, 1 or Hq, Tq, T_total]`` of the named kind (on CPU), or ``None``."""
    if kind is None:
        return None
    keep = torch.ones(B, 1, Tq, T_total, dtype=torch.bool)
    if B > 1:
        keep[1, :, :, : min(7, T_total - 1)] = False  # left padding of row 1
    if kind == "pad-bool":
        keep[0, :, -1, -1] = False
        return keep
    if kind == "pad-float":
        return torch.zeros(B, 1, Tq, T_total).masked_fill(~keep, float("-inf"))
    if kind == "float-per-head":
        g = torch.Generator().manual_seed(11)
        m = torch.randn(B, Hq, Tq, T_total, generator=g)  # finite additive bias per head
        return m.masked_fill(~keep, float("-inf"))
    if kind == "causal-float":
        m = torch.zeros(B, 1, Tq, T_total)
        for i in range(Tq):  # the last Tq keys are the queries' own positions
            m[:, :, i, T_total - Tq + i + 1 :] = float("-inf")
        return m.masked_fill(~keep, float("-inf"))
    raise AssertionError(kind)
