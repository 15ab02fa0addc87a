"""Shared helpers: the attention routes a runtime test runs on, one generation compared
against the dequantize-then-attend route, and plans / states for cache tests."""

import dataclasses
import os

import pytest
import torch

import kvplan


def triton_runs() -> bool:
    from kvplan.kernels import triton_available

    return triton_available() and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


needs_triton = pytest.mark.skipif(not triton_runs(), reason="needs Triton with CUDA or TRITON_INTERPRET=1 "
                                  "(tests/conftest.py sets it without a GPU)")
KERNELS = [pytest.param("native", id="native"), pytest.param("chunked", id="chunked"),
           pytest.param("triton", id="triton", marks=needs_triton)]
ROUTE_IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12] * 6, [20, 21, 22, 23, 24, 25, 26, 27] * 6])


def generated_cache(model, plan, ids, max_new_tokens: int, attention: str = "auto"):
    """The cache of one greedy ``generate`` on ``ids`` under ``kvplan.load(model, plan, attention)``
    (unloaded after)."""
    kvplan.load(model, plan, attention=attention)
    try:
        return model.generate(input_ids=ids, max_new_tokens=max_new_tokens, do_sample=False,
                              return_dict_in_generate=True).cache
    finally:
        kvplan.unload(model)


def generate_like_dequantize(model, plan, attention: str, ids=ROUTE_IDS, max_new_tokens: int = 40):
    """Greedy generation under ``plan`` on ``attention`` and on the dequantize route; asserts
    the same tokens and close scores, returns ``(out, ref)``."""
    runs = {}
    for route in ("dequantize", attention):
        kvplan.load(model, plan, attention=route)
        runs[route] = model.generate(input_ids=ids, max_new_tokens=max_new_tokens, do_sample=False,
                                     output_scores=True, return_dict_in_generate=True)
    kvplan.unload(model)
    out, ref = runs[attention], runs["dequantize"]
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
    return out, ref


def with_quantizer(plan, **fields):
    """``plan`` with these ``quantizer`` fields changed."""
    return plan.replace(quantizer=dataclasses.replace(plan.quantizer, **fields))


def random_kv(n: int, seed: int, D: int = 16, heads: int = 2):
    """Seeded random key and value states ``[1, heads, n, D]``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, heads, n, D, generator=g), torch.randn(1, heads, n, D, generator=g)


def prefill_then_decode(cache, decode_steps: int, prefill: int = 37, D: int = 64):
    """Write ``prefill`` tokens, then one token ``decode_steps`` times, into every layer of ``cache``
    (seeded :func:`random_kv` states); yields the total length after each step."""
    T = 0
    for step, t_new in enumerate([prefill] + [1] * decode_steps):
        for layer in cache.layers:
            layer.update(*random_kv(t_new, 100 * step + layer.layer_idx, D=D))
        T += t_new
        yield T
