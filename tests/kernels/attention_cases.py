"""Shared packed-cache cases for the decode-attention kernels (Triton and chunked PyTorch),
checked against ``attention_reference.reference_decode_attention``.

Blocks are always encoded on the CPU by the PyTorch reference quantizer (``PackedBlock.encode``
on CPU tensors), and the oracle reads those CPU blocks: a kernel under test only ever sees
copies moved to its device (:func:`on_device`), so no Triton op sits on the oracle's side.
"""

from __future__ import annotations

import dataclasses
import torch

from kvplan.kernels.formats import Format, default_codebook
from kvplan.kernels.rotation import Rotation, hadamard_matrix
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


def _inv_freq(rotary_dim, theta=10000.0):
    return 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)


def _codec(codec: str, D: int):
    """``codec``: ``"H"`` (Hadamard), ``"rope"`` (pre-RoPE keys, full rotary), ``"rope/2"`` (rotary
    on half the channels), joined by ``+``; ``"corr"`` adds the key correction (rank 2);
    ``"formats"`` stores keys as Lloyd-Max min-max codes with e4m3 scales and values as Lloyd-Max
    symmetric codes with e4m3 scales (:mod:`kvplan.kernels.formats`; see :func:`block_format`).
    Returns ``(key Rotation or None, value Rotation or None, correction rank)``."""
    parts = set(codec.split("+")) if codec else set()
    H = hadamard_matrix(D) if "H" in parts else None
    inv = _inv_freq(D) if "rope" in parts else _inv_freq(D // 2) if "rope/2" in parts else None
    k_rot = None if H is None and inv is None else Rotation(H, inv)
    return k_rot, None if H is None else Rotation(H), 2 if "corr" in parts else 0


def block_format(codec: str, kind: str, bits: int, axis: str, D: int) -> Format | None:
    """The slot format of a block under ``codec`` (``None``: v1)."""
    if "formats" not in codec.split("+") or bits == 16:
        return None
    scaling = "minmax-e4m3" if kind == "k" else "absmax-e4m3"
    glen = GROUP_SIZE if axis == "channel" else min(GROUP_SIZE, D)
    return Format(bits, scaling, default_codebook(bits, scaling, glen) if bits <= 4 else None)


def make_cache(B, Hkv, D, dtype, segments, Tr, seed, codec=""):
    """segments: list of (T, [(heads, bits, axis)] for K, [(heads, bits, axis)] for V); group 32.
    ``codec`` (see :func:`_codec`): the rotations / key correction of every quantized block
    (the correction on channel-axis key blocks), as a plan sets them.

    Returns CPU ``(key_blocks, value_blocks, key_residual, value_residual, T_total)``, encoded by
    the reference quantizer.
    """
    k_rot, v_rot, rank = _codec(codec, D)
    basis = None
    if rank:
        g = torch.Generator().manual_seed(seed + 900)
        basis = torch.linalg.qr(torch.randn(Hkv, D, D, generator=g))[0][..., :rank].contiguous()  # [H_kv, D, r]
    key_blocks, value_blocks = [], []
    start = 0
    for i, (T, kspec, vspec) in enumerate(segments):
        k = rand((B, Hkv, T, D), dtype, seed=seed + 10 * i)
        v = rand((B, Hkv, T, D), dtype, seed=seed + 10 * i + 1, scale=0.5)
        key_blocks.append([PackedBlock.encode(k[:, list(h)].contiguous(), h, bits, ax, GROUP_SIZE, start,
                                              basis[list(h)] if basis is not None and ax == "channel" else None,
                                              rotation=k_rot, fmt=block_format(codec, "k", bits, ax, D))
                           for h, bits, ax in kspec])
        value_blocks.append([PackedBlock.encode(v[:, list(h)].contiguous(), h, bits, ax, GROUP_SIZE, start,
                                                rotation=v_rot, fmt=block_format(codec, "v", bits, ax, D))
                             for h, bits, ax in vspec])
        start += T
    kr = rand((B, Hkv, Tr, D), dtype, seed=seed + 500) if Tr else None
    vr = rand((B, Hkv, Tr, D), dtype, seed=seed + 501) if Tr else None
    return key_blocks, value_blocks, kr, vr, start + Tr


def on_device(blocks_per_segment, device):
    """Copies of CPU blocks on ``device`` (codes, scales, correction, basis and rotation moved)."""
    device = torch.device(device)
    rotations = {}

    def move(blk):
        if blk.codes.device == device:
            return blk
        rot = blk.rotation
        if rot is not None and id(rot) not in rotations:
            rotations[id(rot)] = Rotation(None if rot.hadamard is None else rot.hadamard.to(device),
                                          None if rot.inv_freq is None else rot.inv_freq.to(device))
        to = (lambda t: None if t is None else t.to(device))  # noqa: E731
        return dataclasses.replace(blk, codes=to(blk.codes), scale=to(blk.scale), zero=to(blk.zero),
                                   basis=to(blk.basis), rotation=None if rot is None else rotations[id(rot)],
                                   correction=None if blk.correction is None else move(blk.correction))

    return [[move(b) for b in blocks] for blocks in blocks_per_segment]


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
    # the searched plans' codec (Hadamard K and V, pre-RoPE keys, key correction) on mixed bits,
    # scattered heads, 16-bit slots and a second segment starting mid-group
    "codec-searched": (
        3,
        [
            (37, [((0, 2), 2, "channel"), ((1,), 3, "channel")], [((0, 1, 2), 2, "token")]),
            (45, [((0,), 16, "channel"), ((1, 2), 4, "channel")], [((0,), 3, "token"), ((1, 2), 16, "token")]),
        ],
        5,
    ),
    "one-seg-no-residual": (1, [(40, [((0,), 3, "channel")], [((0,), 2, "token")])], 0),
}

CODECS = {"codec-searched": "H+rope+corr", "codec-had": "H+corr", "codec-rope-half": "rope/2+corr",
          "formats-searched": "H+rope+corr+formats", "formats-plain": "formats"}
PLANS["codec-had"] = PLANS["mixed-2seg"]
PLANS["codec-rope-half"] = PLANS["int4-kivi-3seg"]
PLANS["formats-searched"] = PLANS["codec-searched"]
PLANS["formats-plain"] = PLANS["mixed-2seg"]

ATTN_CASES = {
    # id: (plan, dtype, n_rep, Tq, D, mask); the plan's codec is CODECS.get(plan, "")
    "mixed-fp32-gqa3-tq2-padmask": ("mixed-2seg", torch.float32, 3, 2, 64, "pad-bool"),
    "mixed-fp16-gqa7-tq1-padmask": ("mixed-2seg", torch.float16, 7, 1, 64, "pad-bool"),
    "mixed-bf16-gqa2-tq3-floatmask": ("mixed-2seg", torch.bfloat16, 2, 3, 64, "float-per-head"),
    "kivi-fp16-D128-nomask": ("int4-kivi-3seg", torch.float16, 4, 1, 128, None),
    "kivi-fp32-D128-causal": ("int4-kivi-3seg", torch.float32, 1, 3, 128, "causal-float"),
    "residual-only-fp16": ("residual-only", torch.float16, 2, 1, 64, "pad-bool"),
    "one-seg-fp32-mha": ("one-seg-no-residual", torch.float32, 1, 1, 64, "pad-float"),
    "searched-fp32-gqa3-tq1-padmask": ("codec-searched", torch.float32, 3, 1, 64, "pad-bool"),
    "searched-fp16-gqa3-tq1-padmask": ("codec-searched", torch.float16, 3, 1, 64, "pad-bool"),
    "searched-bf16-gqa2-tq2-floatmask": ("codec-searched", torch.bfloat16, 2, 2, 64, "float-per-head"),
    "had-corr-fp16-gqa7-tq1-padfloat": ("codec-had", torch.float16, 7, 1, 64, "pad-float"),
    "rope-half-fp32-D128-causal": ("codec-rope-half", torch.float32, 1, 3, 128, "causal-float"),
    "rope-half-bf16-D128-nomask": ("codec-rope-half", torch.bfloat16, 4, 1, 128, None),
    # slot formats of the registry (e4m3 scales, symmetric values, codebooks)
    "formats-searched-fp32-gqa3-tq1-padmask": ("formats-searched", torch.float32, 3, 1, 64, "pad-bool"),
    "formats-plain-fp32-gqa2-tq2-floatmask": ("formats-plain", torch.float32, 2, 2, 64, "float-per-head"),
}


def case_cache(case, B, seed):
    """``(q, key_blocks, value_blocks, key_residual, value_residual, mask)`` of an ATTN_CASES entry, on CPU."""
    plan, dtype, n_rep, Tq, D, mask_kind = case
    Hkv, segments, Tr = PLANS[plan]
    kb, vb, kr, vr, T_total = make_cache(B, Hkv, D, dtype, segments, Tr, seed, CODECS.get(plan, ""))
    q = rand((B, Hkv * n_rep, Tq, D), dtype, seed=99, scale=0.5)
    return q, kb, vb, kr, vr, mask(mask_kind, B, Hkv * n_rep, Tq, T_total)


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


def assert_matches_reference(kernel, case, B: int = 2) -> None:
    """``kernel`` (a decode-attention function) equals the reference on an ATTN_CASES entry, for the
    default softmax scale and another one, in the query's dtype, finite."""
    from kvplan.kernels.attention_reference import reference_decode_attention

    q, kb, vb, kr, vr, m = case_cache(case, B=B, seed=case[4] + case[2])
    for sm_scale in (None, 0.1):
        ref = reference_decode_attention(q, kb, vb, kr, vr, m, sm_scale)
        out = kernel(q, kb, vb, kr, vr, m, sm_scale)
        assert out.dtype == q.dtype and out.shape == q.shape
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.float(), ref.float(), atol=ATTN_TOL[q.dtype][0], rtol=ATTN_TOL[q.dtype][1])
