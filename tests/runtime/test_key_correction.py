"""The HeadQ-style key correction at runtime: storage, cache bytes, generation on every route."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import kvplan
from kvplan import Geometry, uniform_plan
from kvplan.plans import CORRECTED
from kvplan.runtime.storage import PackedBlock
from kvplan.search import query_basis
from tests.runtime.routes import KERNELS, generate_like_dequantize
from tests.tiny_models import tiny_llama


def _basis(h, D, r, seed=0):
    q, _ = torch.linalg.qr(torch.randn(h, D, D, generator=torch.Generator().manual_seed(seed)))
    return q[..., :r].contiguous()  # [h, D, r] orthonormal columns


def test_correction_removes_the_error_inside_the_basis_only():
    x = torch.randn(2, 3, 150, 64, generator=torch.Generator().manual_seed(1))
    U = _basis(3, 64, 8)
    plain = PackedBlock.encode(x, (0, 1, 2), 2, "channel", 32, 37)
    corr = PackedBlock.encode(x, (0, 1, 2), 2, "channel", 32, 37, basis=U, correction_bits=4)
    e_plain = x - plain.decode(torch.float32)
    e_corr = x - corr.decode(torch.float32)
    inside = lambda e: torch.matmul(e, U)  # noqa: E731  [B, h, T, r]
    assert inside(e_corr).norm() < 0.15 * inside(e_plain).norm()  # 4-bit code of the in-basis error
    outside = lambda e: e - torch.matmul(inside(e), U.transpose(-1, -2))  # noqa: E731
    torch.testing.assert_close(outside(e_corr), outside(e_plain), atol=1e-4, rtol=1e-4)
    assert corr.nbytes_parts()["correction"] > 0 and plain.nbytes_parts()["correction"] == 0
    assert corr.nbytes_parts()["payload"] == plain.nbytes_parts()["payload"]


def test_views_and_appends_of_corrected_blocks_decode_like_the_whole():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 200, 64, generator=gen)
    U = _basis(3, 64, 4)
    block = PackedBlock.encode(x, (0, 2, 3), 2, "channel", 32, 37, basis=U)
    whole = block.decode(torch.float32)
    pieces = torch.cat([p.decode(torch.float32) for _, _, p in block.token_chunks(64)], dim=2)
    assert torch.equal(pieces, whole)
    heads = torch.cat([b.decode(torch.float32) for _, _, b in block.head_runs()], dim=1)
    assert torch.equal(heads, whole)
    out = torch.empty_like(whole)
    block.decode_into(out)
    assert torch.equal(out, whole)
    # committed in two steps (the second starts on a group boundary) = one encode of both parts
    first = PackedBlock.encode(x[:, :, :91], (0, 2, 3), 2, "channel", 32, 37, basis=U)
    first.append(PackedBlock.encode(x[:, :, 91:], (0, 2, 3), 2, "channel", 32, 128, basis=U))
    assert torch.equal(first.decode(torch.float32), whole)
    first.map_tensors(lambda t: t[[1, 0]])  # batch reordering reaches the correction code
    assert torch.equal(first.decode(torch.float32), whole[[1, 0]])


def _corrected(plan, model, rank, which=None):
    """``plan`` with the key correction (bases learned on a few random sequences) on the
    quantized key slots selected by ``which`` (default: all)."""
    ids = [list(range(3 + i, 60 + i)) for i in range(3)]
    basis = query_basis(model, ids, rank)
    codes = plan.table()
    sel = np.zeros(codes.shape, dtype=bool)
    sel[:, :, 0] = True if which is None else which
    codes[sel & (codes < 16)] += CORRECTED
    q = dataclasses.replace(plan.quantizer, key_correction_rank=rank)
    return plan.with_table(codes, quantizer=q, key_basis=basis)


@pytest.mark.parametrize("attention", KERNELS)
def test_generation_with_corrected_keys_on_every_route(attention):
    model = tiny_llama()
    g = Geometry.of(model)
    which = np.zeros((g.num_layers, g.num_kv_heads, 1), dtype=bool)
    which[:, 1] = True  # KV head 1 corrected, head 0 not: two kinds of key blocks in one layer
    plan = _corrected(uniform_plan(g, 2, 4, residual_length=8, group_size=32), model, 4, which)
    out, ref = generate_like_dequantize(model, plan, attention)
    parts = out.cache.nbytes_breakdown()
    assert parts == ref.cache.nbytes_breakdown()
    n_values = out.cache.num_values()
    labels = ["text"] * out.cache.get_seq_length()
    predicted = plan.bpv(context_len=len(labels), modality_mix=labels, full_precision_bits=32)
    assert parts["correction"] > 0
    assert 8 * parts["correction"] / n_values == predicted.correction
    assert out.cache.bpv() == predicted.total


def test_correction_brings_logits_closer_to_full_precision():
    model = tiny_llama(head_dim=32, seed=3)
    g = Geometry.of(model)
    ids = torch.randint(3, 250, (2, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(input_ids=ids).logits[:, -32:]
    plain = uniform_plan(g, 2, 16, residual_length=0, group_size=32)
    errors = {}
    for name, plan in (("plain", plain), ("corrected", _corrected(plain, model, 24))):
        cache = kvplan.KVPlanCache(plan, model)
        with torch.no_grad():
            model(input_ids=ids[:, :64], cache=cache)  # the history is committed at 2 bits
            logits = model(input_ids=ids[:, 64:], cache=cache).logits
        errors[name] = float((logits - full).pow(2).mean())
    assert errors["corrected"] < 0.5 * errors["plain"], errors
