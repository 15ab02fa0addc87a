"""Chunked PyTorch decode attention (attention="chunked"; the CPU route without a C compiler) against the reference."""

from __future__ import annotations

import pytest
import torch

from kvplan import kernels
from kvplan.kernels import attention_chunked, decode_attention
from kvplan.kernels.attention_chunked import chunked_decode_attention
from tests.kernels.attention_cases import ATTN_CASES, PLANS, assert_matches_reference, make_cache, rand

# 1 byte -> every chunk is one group (32 tokens): many chunks, chunk ends inside segments and
# a first chunk that starts mid-group; the default -> one chunk per block at these sizes
CHUNK_BYTES = {"group-chunks": 1, "default": attention_chunked.CHUNK_BYTES}


@pytest.mark.parametrize("chunk_bytes", list(CHUNK_BYTES.values()), ids=list(CHUNK_BYTES))
@pytest.mark.parametrize("case", list(ATTN_CASES.values()), ids=list(ATTN_CASES))
def test_chunked_matches_reference(case, chunk_bytes, monkeypatch):
    monkeypatch.setattr(attention_chunked, "CHUNK_BYTES", chunk_bytes)
    assert_matches_reference(chunked_decode_attention, case)


def test_dispatcher_uses_chunked_on_cpu_when_native_is_off(monkeypatch):
    monkeypatch.setenv("KVPLAN_DISABLE_NATIVE", "1")
    kernels._warn_chunked_once.cache_clear()  # it warns once per process and reason
    Hkv, segments, Tr = PLANS["int4-kivi-3seg"]
    kb, vb, kr, vr, _ = make_cache(1, Hkv, 64, torch.float32, segments, Tr, seed=3)
    q = rand((1, 2 * Hkv, 1, 64), torch.float32, seed=4)
    with pytest.warns(RuntimeWarning, match="KVPLAN_DISABLE_NATIVE=1.*chunked"):
        out = decode_attention(q, kb, vb, kr, vr)
    assert torch.equal(out, chunked_decode_attention(q, kb, vb, kr, vr))


def test_the_cuda_dispatch_without_triton_warns_that_it_uses_chunked(monkeypatch):
    """attention="auto" on a CUDA model without an importable Triton took the chunked kernel silently."""
    from kvplan.kernels import decode_attention_kernel

    monkeypatch.setenv("KVPLAN_DISABLE_TRITON", "1")
    kernels._warn_chunked_once.cache_clear()
    kernels.triton_available.cache_clear()  # cached per process: asked again under the variable, and after it
    try:
        with pytest.warns(RuntimeWarning, match="the fused Triton CUDA decode attention is not available \\(Triton "
                                                "cannot be imported\\); using the chunked PyTorch kernel"):
            assert decode_attention_kernel(cuda=True, head_dim=64) is chunked_decode_attention
    finally:
        kernels.triton_available.cache_clear()


def test_no_keys_is_an_error():
    q = torch.zeros(1, 2, 1, 64)
    with pytest.raises(ValueError, match="no keys"):
        chunked_decode_attention(q, [], [], None, None)
