"""Rotated storage (quantizer.rotation / key_pre_rope): blocks, cache, generation on every route."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kvplan
from kvplan import Geometry, uniform_plan
from kvplan.kernels.rotation import Rotation, hadamard_matrix, rope_rotate
from kvplan.models import rope_inv_freq
from kvplan.runtime.storage import PackedBlock
from tests.runtime.routes import KERNELS, generate_like_dequantize, generated_cache
from tests.tiny_models import tiny_llama


def _inv_freq(d, theta=10000.0):
    return 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)


def _err(block, x):
    return float((block.decode(torch.float32) - x).pow(2).mean())


def test_pre_rope_frame_quantizes_rope_rotated_keys_better():
    # keys that are nearly constant before RoPE: after RoPE each channel spins with the position
    D, T = 64, 256
    gen = torch.Generator().manual_seed(0)
    center = torch.randn(1, 2, 1, D, generator=gen) * torch.linspace(0.2, 4.0, D)
    pre = center + 0.05 * torch.randn(1, 2, T, D, generator=gen)
    inv = _inv_freq(D)
    keys = rope_rotate(pre, 0, inv, 1.0)  # what the model caches
    plain = PackedBlock.encode(keys, (0, 1), 2, "channel", 32, 0)
    framed = PackedBlock.encode(keys, (0, 1), 2, "channel", 32, 0, rotation=Rotation(inv_freq=inv))
    assert _err(framed, keys) < 0.2 * _err(plain, keys)


def test_hadamard_spreads_an_outlier_channel():
    x = torch.randn(2, 2, 64, 64, generator=torch.Generator().manual_seed(1))
    x[..., 5] *= 30  # one huge channel: a per-token grid spends its levels on it
    plain = PackedBlock.encode(x, (0, 1), 4, "token", 64, 0)
    rotated = PackedBlock.encode(x, (0, 1), 4, "token", 64, 0, rotation=Rotation(hadamard_matrix(64)))
    assert _err(rotated, x) < 0.5 * _err(plain, x)


def test_views_and_appends_of_rotated_blocks_decode_like_the_whole():
    D = 64
    rot = Rotation(hadamard_matrix(D), _inv_freq(D))
    x = torch.randn(2, 3, 200, D, generator=torch.Generator().manual_seed(2))
    block = PackedBlock.encode(x, (0, 2, 3), 2, "channel", 32, 37, rotation=rot)
    whole = block.decode(torch.float32)
    pieces = torch.cat([p.decode(torch.float32) for _, _, p in block.token_chunks(64)], dim=2)
    torch.testing.assert_close(pieces, whole, atol=1e-5, rtol=1e-5)
    out = torch.empty_like(whole)
    block.decode_into(out)
    assert torch.equal(out, whole)
    first = PackedBlock.encode(x[:, :, :91], (0, 2, 3), 2, "channel", 32, 37, rotation=rot)
    first.append(PackedBlock.encode(x[:, :, 91:], (0, 2, 3), 2, "channel", 32, 128, rotation=rot))
    torch.testing.assert_close(first.decode(torch.float32), whole, atol=1e-5, rtol=1e-5)
    full = PackedBlock.encode(x, (0, 2, 3), 16, "channel", 32, 37, rotation=rot)
    assert full.rotation is None and torch.equal(full.decode(torch.float32), x)  # stored as it is


def _rotated(plan, model, rotation="hadamard", pre_rope=True):
    q = dataclasses.replace(plan.quantizer, rotation=rotation, key_pre_rope=pre_rope)
    return plan.replace(quantizer=q, rope_inv_freq=rope_inv_freq(model) if pre_rope else None)


def test_rope_inv_freq_is_the_models():
    model = tiny_llama(head_dim=16)
    assert rope_inv_freq(model) == tuple(float(f) for f in model.model.rotary_emb.inv_freq)
    assert rope_inv_freq(object()) is None


@pytest.mark.parametrize("attention", KERNELS)
def test_generation_with_rotated_storage_on_every_route(attention):
    model = tiny_llama()
    g = Geometry.of(model)
    plan = _rotated(uniform_plan(g, 2, 4, residual_length=8, group_size=32), model)
    out, _ = generate_like_dequantize(model, plan, attention)
    assert any(b.rotation is not None for seg in out.cache.layers[0].segments["k"] for b in seg.blocks)
    # rotations are plan constants: the same bytes as the unrotated plan
    assert out.cache.bpv() == plan.bpv(context_len=out.cache.get_seq_length(), full_precision_bits=32).total


def test_every_layer_of_a_cache_shares_one_rope_angle_table_per_frequency_set():
    """Each layer kept its own cos/sin tables for every position since 0: at 3000 tokens on a 6-layer
    model they held 36-72 MB, uncounted, against a 1.1 MB cache."""
    from kvplan.models.rope import rope_inv_freq as model_inv_freq
    from tests.tiny_models import tiny_gemma3

    model = tiny_gemma3(num_layers=6, num_kv_heads=1, head_dim=64, sliding_window=16)  # two RoPE bases
    base = uniform_plan(Geometry.of(model), 4, 4, residual_length=8, group_size=32)
    plan = base.replace(rope_inv_freq=model_inv_freq(model),
                        quantizer=dataclasses.replace(base.quantizer, rotation="hadamard", key_pre_rope=True))
    cache = generated_cache(model, plan, torch.randint(3, 250, (1, 90), generator=torch.Generator().manual_seed(0)), 4)
    tables = {}
    for layer in cache.layers:
        rotation = layer.rotation["k"]
        tables.setdefault(tuple(rotation.inv_freq.tolist()), set()).add(id(rotation.table))
    assert len(tables) == 2 and all(len(shared) == 1 for shared in tables.values())
    assert len(cache.angle_tables) == 2
    cache.reset()  # the next prompt's padding makes its own tables
    assert cache.angle_tables == {}


def test_rotated_cache_reads_back_the_right_positions():
    # 8 bits, commits every 32 tokens over prefill and decode: rotated or not, the logits stay
    # near full precision (a read with the wrong position would rotate keys by a wrong angle)
    model = tiny_llama(head_dim=32, seed=3)
    g = Geometry.of(model)
    ids = torch.randint(3, 250, (2, 120), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(input_ids=ids).logits[:, 64:]
    base = uniform_plan(g, 8, 8, residual_length=4, group_size=32)
    errors = {}
    for name, plan in (("plain", base), ("rotated", _rotated(base, model))):
        cache = kvplan.KVPlanCache(plan, model)
        steps = []
        with torch.no_grad():
            model(input_ids=ids[:, :64], cache=cache)
            for t in range(64, 120):  # one token at a time: many commits at moving positions
                steps.append(model(input_ids=ids[:, t : t + 1], cache=cache).logits)
        errors[name] = float((torch.cat(steps, dim=1) - full).pow(2).mean())
    assert errors["rotated"] < 3 * errors["plain"] + 1e-6, errors
    assert errors["plain"] < 1e-3


def test_load_warns_when_the_plans_rope_frequencies_are_not_the_models():
    import warnings

    model = tiny_llama()
    plan = _rotated(uniform_plan(Geometry.of(model), 2, 4, residual_length=8, group_size=32), model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kvplan.make_cache(model, plan)  # the model's own frequencies: silent
    other = plan.replace(rope_inv_freq=tuple(2 * f for f in plan.rope_inv_freq))
    with pytest.warns(UserWarning, match="rope_inv_freq .* differs from this model's RoPE frequencies"):
        kvplan.make_cache(model, other)


def test_the_rope_warning_says_how_far_and_why_and_comes_once_per_model():
    """A plan searched on an fp32 model deployed in bf16 (whose cast rounds the inv_freq buffer) warned at load and
    again at every generate, saying only that the frequencies differed."""
    import warnings

    model = tiny_llama()
    plan = _rotated(uniform_plan(Geometry.of(model), 2, 4, residual_length=8, group_size=32), model)
    model.to(torch.bfloat16)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            kvplan.make_cache(model, plan)
    said = [str(w.message) for w in seen if "rope_inv_freq" in str(w.message)]
    assert len(said) == 1, said
    assert "relative difference up to" in said[0] and "this model keeps them in bfloat16, which rounds them" in said[0]
