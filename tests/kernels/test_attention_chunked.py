"""Chunked PyTorch decode attention (the CPU default) against the reference."""

from __future__ import annotations

import pytest
import torch

from kvplan import kernels
from kvplan.kernels import attention_chunked, decode_attention
from kvplan.kernels.attention_chunked import chunked_decode_attention
from kvplan.kernels.attention_reference import reference_decode_attention
from tests.kernels.attention_cases import ATTN_CASES, ATTN_TOL, PLANS, case_cache, make_cache, rand

# 1 byte -> every chunk is one group (32 tokens): many chunks, chunk ends inside segments and
# a first chunk that starts mid-group; the default -> one chunk per block at these sizes
CHUNK_BYTES = {"group-chunks": 1, "default": attention_chunked.CHUNK_BYTES}


@pytest.mark.parametrize("chunk_bytes", list(CHUNK_BYTES.values()), ids=list(CHUNK_BYTES))
@pytest.mark.parametrize("case", list(ATTN_CASES.values()), ids=list(ATTN_CASES))
def test_chunked_matches_reference(case, chunk_bytes, monkeypatch):
    monkeypatch.setattr(attention_chunked, "CHUNK_BYTES", chunk_bytes)
    q, kb, vb, kr, vr, m = case_cache(case, B=2, seed=case[4] + case[2])
    for sm_scale in (None, 0.1):
        ref = reference_decode_attention(q, kb, vb, kr, vr, m, sm_scale)
        out = chunked_decode_attention(q, kb, vb, kr, vr, m, sm_scale)
        assert out.dtype == q.dtype and out.shape == q.shape
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.float(), ref.float(), atol=ATTN_TOL[q.dtype][0], rtol=ATTN_TOL[q.dtype][1])


def test_dispatcher_uses_chunked_on_cpu_when_native_is_off(monkeypatch):
    monkeypatch.setenv("KVPLAN_DISABLE_NATIVE", "1")
    kernels._warn_chunked_once.cache_clear()  # it warns once per process and reason
    Hkv, segments, Tr = PLANS["int4-kivi-3seg"]
    kb, vb, kr, vr, _ = make_cache(1, Hkv, 64, torch.float32, segments, Tr, seed=3)
    q = rand((1, 2 * Hkv, 1, 64), torch.float32, seed=4)
    with pytest.warns(RuntimeWarning, match="KVPLAN_DISABLE_NATIVE=1.*chunked"):
        out = decode_attention(q, kb, vb, kr, vr)
    assert torch.equal(out, chunked_decode_attention(q, kb, vb, kr, vr))


def test_no_keys_is_an_error():
    q = torch.zeros(1, 2, 1, 64)
    with pytest.raises(ValueError, match="no keys"):
        chunked_decode_attention(q, [], [], None, None)
