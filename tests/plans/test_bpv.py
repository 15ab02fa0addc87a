"""The plan's predicted honest bpv equals the bytes a real filled cache holds."""

import numpy as np
import pytest
import torch

from kvplan import Geometry, KVPlanCache, baseline_plan, headguard_plan, uniform_plan
from kvplan.plans import CORRECTED, Reference, layout_labels

GEOM = Geometry(4, 3, 64, ("full",) * 4, "llama")


def _fill(cache, labels, dtype, chunks, batch=2, seed=0):
    """Write len(labels) tokens: a prefill of chunks[0] tokens, then the rest in chunks."""
    gen = torch.Generator().manual_seed(seed)
    cache.assign_labels(labels)
    written, sizes = 0, list(chunks)
    while written < len(labels):
        n = min(sizes.pop(0) if sizes else 16, len(labels) - written)
        for layer in cache.layers:
            k = torch.randn(batch, 3, n, 64, generator=gen).to(dtype)
            v = torch.randn(batch, 3, n, 64, generator=gen).to(dtype)
            layer.update(k, v)
        written += n


def _random_plan(seed, modalities, sink_length=0):
    rng = np.random.default_rng(seed)
    plan = uniform_plan(GEOM, 4, modalities=modalities, group_size=int(rng.choice([32, 64, 128])),
                        residual_length=int(rng.choice([0, 16, 128])),
                        key_axis=str(rng.choice(["channel", "token"])), sink_length=sink_length)
    return plan.with_table(rng.choice([2, 3, 4, 8, 16], size=plan.table().shape))


def _corrected_plan(seed, modalities, rank, sink_length=0):
    """Random plan (channel-axis keys) whose quantized key slots are corrected at random."""
    import dataclasses

    rng = np.random.default_rng(seed)
    plan = _random_plan(seed, modalities, sink_length)
    q = dataclasses.replace(plan.quantizer, key_axis="channel", key_correction_rank=rank,
                            key_correction_bits=int(rng.choice([2, 3, 4, 8])))
    codes = plan.table()
    pick = (rng.random(codes.shape) < 0.6) & (codes < 16)
    pick[:, :, 1] = False
    codes[pick] += CORRECTED
    basis = np.linalg.qr(rng.standard_normal((4, 3, 64, 64)))[0][..., :rank]
    return plan.with_table(codes, quantizer=q, key_basis=basis)


PLANS = {
    "int2": lambda: baseline_plan("int2", GEOM),
    "int4-g128": lambda: baseline_plan("int4-g128", GEOM),
    "k4v2-r0": lambda: baseline_plan("k4v2", GEOM, residual_length=0),
    "fp16": lambda: baseline_plan("fp16", GEOM),
    "headguard": lambda: headguard_plan(GEOM, [(1, 2)], modalities=("text", "visual"), protected_modality="visual"),
    "random0": lambda: _random_plan(0, ("text", "visual")),
    "random1": lambda: _random_plan(1, ("text", "visual", "doc")),
    "random2": lambda: _random_plan(2, ("text",)),
    # attention sinks: inside the first key group, across a group boundary, longer than a modality run
    "int2-sink1": lambda: baseline_plan("int2", GEOM, residual_length=0, sink_length=1),
    "random3-sink37": lambda: _random_plan(3, ("text", "visual"), sink_length=37),
    "random4-sink150": lambda: _random_plan(4, ("text", "doc"), sink_length=150),
    # HeadQ-style key correction on some key slots: its codes and scales are counted as "correction"
    "corrected5-r4": lambda: _corrected_plan(5, ("text", "visual"), 4),
    "corrected6-r3-sink37": lambda: _corrected_plan(6, ("text", "doc"), 3, sink_length=37),
}
MIXES = {
    "text": [("text", 1.0)],
    "vlm": [("text", 0.02), ("visual", 0.9), ("text", 0.08)],
    "doc": [("text", 0.1), ("doc", 0.8), ("text", 0.1)],
}


def _cases():
    for name, make in PLANS.items():
        modalities = set(make().modalities)
        for mix, spans in MIXES.items():
            if {m for m, _ in spans} <= modalities:
                for length in (1, 31, 200, 517):
                    yield name, mix, length


@pytest.mark.parametrize("name,mix,length", list(_cases()))
def test_predicted_bpv_equals_measured(name, mix, length):
    plan = PLANS[name]()
    spans = MIXES[mix]
    # repeated modality names are allowed in a layout: build labels span by span
    labels = []
    for i, (m, f) in enumerate(spans):
        n = length - len(labels) if i == len(spans) - 1 else int(f * length)
        labels += [m] * n
    for dtype in (torch.float16, torch.float32):
        cache = KVPlanCache(plan)
        _fill(cache, labels, dtype, chunks=[length // 2, 3, 1, 1, 40])
        predicted = plan.bpv(context_len=length, modality_mix=labels, full_precision_bits=8 * dtype.itemsize)
        measured = 8 * cache.nbytes() / cache.num_values()
        assert measured == predicted.total
        parts = cache.nbytes_breakdown()
        n_values = cache.num_values()
        assert 8 * parts["scales_zeros"] / n_values == predicted.scales_zeros
        assert 8 * parts["residual"] / n_values == predicted.residual
        assert 8 * parts["correction"] / n_values == predicted.correction


def test_key_correction_cost_by_hand():
    """Every key corrected, rank 4 at 4 bits, group 128, no residual, 1024 text tokens: per key
    token and head 2 bytes of codes + 4 components x (scale + zero) per 128 tokens."""
    import dataclasses

    plan = baseline_plan("int2", GEOM, residual_length=0, group_size=128)
    q = dataclasses.replace(plan.quantizer, key_correction_rank=4, key_correction_bits=4)
    codes = plan.table()
    codes[:, :, 0] += CORRECTED
    plan = plan.with_table(codes, quantizer=q, key_basis=np.zeros((4, 3, 64, 4)))
    bpv = plan.bpv(context_len=1024, modality_mix={"text": 1.0})
    per_key_token_bits = 8 * (2 + 4 * 4 / 128)  # 17 bits per key token and head
    assert bpv.correction == per_key_token_bits / (2 * 64)
    assert bpv.total == 2.0 + 0.375 + per_key_token_bits / 128


def test_int2_group32_is_three_bits_per_value():
    plan = baseline_plan("int2", GEOM, residual_length=0)
    bpv = plan.bpv(context_len=4096, modality_mix={"text": 1.0})
    assert bpv.total == 3.0 and bpv.payload == 2.0 and bpv.scales_zeros == 1.0 and bpv.residual == 0.0


@pytest.mark.parametrize("seed,sink_length", [(3, 0), (5, 37)])
def test_bpv_independent_of_arrival_pattern(seed, sink_length):
    plan = _random_plan(seed, ("text", "visual"), sink_length=sink_length)
    labels = layout_labels(300, [("text", 0.1), ("visual", 0.9)])
    sizes = []
    for chunks in ([300], [1] * 300, [7, 64, 5, 100]):
        cache = KVPlanCache(plan)
        _fill(cache, labels, torch.float16, chunks=chunks, batch=1)
        sizes.append(cache.nbytes_breakdown())
    assert sizes[0] == sizes[1] == sizes[2]


def test_reference_layout_in_plan():
    plan = headguard_plan(GEOM, [(0, 0)], modalities=("text", "visual"),
                          reference=Reference(1000, {"text": 0.1, "visual": 0.9}))
    assert plan.bpv() == plan.bpv(context_len=1000, modality_mix={"text": 0.1, "visual": 0.9})


def test_sink_tokens_cost_full_precision():
    """One sink token at 512 tokens costs exactly its 16-bit storage minus its int2 storage."""
    base = baseline_plan("int2-g128", GEOM, residual_length=0)
    sink = baseline_plan("int2-g128", GEOM, residual_length=0, sink_length=1)
    b0 = base.bpv(context_len=512, modality_mix={"text": 1.0}).total
    b1 = sink.bpv(context_len=512, modality_mix={"text": 1.0}).total
    # keys per channel: the first key group still needs its scales; values per token lose one token's scales
    per_token = 2 * 64 * 2 - (2 * 64 * 2 // 8 + 4)  # 16-bit K and V instead of 2-bit K and V codes + V scale/zero
    assert (b1 - b0) * 2 * 512 * 64 / 8 == pytest.approx(per_token, rel=1e-12)


@pytest.mark.parametrize("kwargs,message", [
    (dict(context_len=0), r"context_len: must be in \[1, 16777216\] \(got 0\)"),  # was a ZeroDivisionError
    (dict(context_len=-5), r"context_len: must be in \[1, 16777216\] \(got -5\)"),  # was -0.0 bpv
    (dict(context_len=1.5), r"context_len: must be an integer \(got 1.5\)"),  # was 16.0 bpv
    (dict(context_len=64, full_precision_bits=12), r"full_precision_bits: must be one of \[16, 32\] \(got 12\)"),
])
def test_plan_bpv_refuses_a_length_or_storage_width_no_cache_can_have(kwargs, message):
    """Out-of-range arguments were computed (or divided by zero) instead of refused; a numpy length still counts."""
    from kvplan import PlanError

    plan = uniform_plan(GEOM, 2, group_size=32, residual_length=0)
    with pytest.raises(PlanError, match=message):
        plan.bpv(**kwargs)
    assert plan.bpv(context_len=np.int64(64)).total == plan.bpv(context_len=64).total


def test_a_model_whose_windows_keep_no_token_stores_zero_bits_as_its_cache_says():
    """A sliding window of 1 frees every committed group: plan.bpv divided 0 bytes by 0 values (ZeroDivisionError,
    also inside kvplan.load's storage check) where the cache reports 0.0."""
    geometry = Geometry(2, 2, 64, ("sliding", "sliding"), "mistral", sliding_window=1)
    plan = uniform_plan(geometry, 2, group_size=32, residual_length=0)
    cache = KVPlanCache(plan)
    g = torch.Generator().manual_seed(0)
    for layer in cache.layers:
        layer.update(torch.randn(1, 2, 64, 64, generator=g), torch.randn(1, 2, 64, 64, generator=g))
    assert cache.bpv() == 0.0 == plan.bpv(context_len=64, full_precision_bits=32).total
    assert plan.bpv(context_len=33, full_precision_bits=32).total > 0  # the newest token is still held
