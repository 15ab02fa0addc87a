"""A plan's feedback_metric at runtime: the cache's slot codes are chosen by error feedback (same
bytes, same decode on every route) and the metric-weighted error of what it reads drops."""

import dataclasses

import numpy as np
import pytest
import torch

from kvplan import Geometry, KVPlanCache, uniform_plan
from kvplan.runtime.cache import plan_rotations
from kvplan.search.feedback_metric import feedback_metric, output_projections
from kvplan.search.key_basis import query_second_moments
from tests.runtime.routes import KERNELS, generate_like_dequantize
from tests.tiny_models import tiny_llama

IDS = [list(range(5, 90)), list(range(40, 160, 2))]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(head_dim=32, seed=3)


def _plans(model, **quantizer):
    """The same plan without and with the metric learned from ``model`` (Hadamard, pre-RoPE keys)."""
    g = Geometry.of(model)
    from kvplan.models.rope import rope_inv_freq

    base = uniform_plan(g, 2, 2, residual_length=8, group_size=32)
    q = dataclasses.replace(base.quantizer, rotation="hadamard", key_pre_rope=True, **quantizer)
    plain = base.replace(quantizer=q, rope_inv_freq=rope_inv_freq(model))
    metric = feedback_metric(query_second_moments(model, IDS), output_projections(model, g.num_layers),
                             lambda layer: plan_rotations(plain, "cpu", layer), 128)
    assert metric.shape == (g.num_layers, 2, g.num_kv_heads, 32, 32)
    return plain, plain.replace(feedback_metric=metric)


def test_metric_is_symmetric_with_unit_mean_diagonal_plus_damping(model):
    _, plan = _plans(model)
    m = plan.feedback_metric.array.astype(np.float64)
    np.testing.assert_array_equal(m, np.swapaxes(m, -1, -2))
    np.testing.assert_allclose(np.diagonal(m, axis1=-2, axis2=-1).mean(-1), 1.1, rtol=2e-3)
    assert (np.linalg.eigvalsh(m) > 0.05).all()


@pytest.mark.parametrize("head_dim,rotary,hadamard", [(32, 16, True), (32, 8, True), (16, 8, False), (16, None, True)],
                         ids=["full-rope", "partial-rope", "rope-only", "hadamard-only"])
def test_stored_key_metric_is_the_mean_over_positions_of_the_stored_frame_metric(head_dim, rotary, hadamard):
    """The closed form equals the definition: a unit stored error on coordinate a at index p reads as
    N_p[a] = Rotation.inverse(e_a) in the model frame; the metric is mean_p N_p M N_pᵀ."""
    from kvplan.kernels.rotation import Rotation, hadamard_matrix
    from kvplan.search.feedback_metric import stored_key_metric

    g = torch.Generator().manual_seed(head_dim)
    a = torch.randn(2, head_dim, head_dim, generator=g, dtype=torch.float64)
    m = a @ a.transpose(-1, -2)
    inv_freq = None if rotary is None else 1.0 / 10000 ** (torch.arange(rotary, dtype=torch.float32) / rotary)
    rot = Rotation(hadamard_matrix(head_dim) if hadamard else None, inv_freq)
    P = 37
    units = torch.eye(head_dim).view(1, head_dim, 1, head_dim).expand(1, head_dim, P, head_dim).contiguous()
    n = rot.inverse(units, 0)[0].permute(1, 0, 2).double()  # [P, D, D]: N_p
    want = torch.einsum("pad,hde,pbe->hab", n, m, n) / P
    got = stored_key_metric(m, rot, P)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))


def test_codes_change_bytes_do_not_and_the_metric_error_drops(model):
    """Under a plan metric with a few dominant directions (as trained models' queries have; this
    random-weight model's are near isotropic) the cache's reads have a much lower e^T M e."""
    plain, fb = _plans(model)
    g = torch.Generator().manual_seed(4)
    a = torch.randn(*fb.feedback_metric.shape[:3], 32, 3, generator=g) * torch.tensor([6.0, 3.0, 1.0])
    skewed = a @ a.transpose(-1, -2)
    skewed = skewed / torch.diagonal(skewed, dim1=-2, dim2=-1).mean(-1)[..., None, None] + 0.1 * torch.eye(32)
    fb = fb.replace(feedback_metric=((skewed + skewed.transpose(-1, -2)) / 2).numpy())
    states = torch.randn(1, 2, 70, 32, generator=torch.Generator().manual_seed(0)) * 3
    caches = {}
    for name, plan in (("plain", plain), ("feedback", fb)):
        cache = KVPlanCache(plan, model)
        for layer in cache.layers:
            layer.update(states, states.flip(-1))
        caches[name] = cache
    assert caches["plain"].nbytes_breakdown() == caches["feedback"].nbytes_breakdown()
    for kind, x in (("k", states), ("v", states.flip(-1))):
        errors = {}
        for name, cache in caches.items():
            layer = cache.layers[0]
            blocks = [b for seg in layer.segments[kind] for b in seg.blocks]
            assert blocks and all(b.bits == 2 for b in blocks)
            # the metric lives in the stored (rotated) frame: compare there
            rot = layer.rotation[kind]
            e = rot.forward(x[:, :, :64], 0) - rot.forward(layer._read(kind)[:, :, :64], 0)
            m = torch.from_numpy(fb.feedback_metric.array[0, 0 if kind == "k" else 1].astype("float32"))
            errors[name] = torch.einsum("bhtd,hde,bhte->", e, m, e).item()
        assert errors["feedback"] < 0.8 * errors["plain"], (kind, errors)


def test_caches_of_one_plan_share_its_factorized_metric(model, monkeypatch):
    """The metric is factorized once per layer (a plan constant), not once per cache: a second cache
    of the plan (e.g. the next scored sample) reuses the same tensors, which equal a fresh
    factorization; a plan with another metric gets its own."""
    from kvplan.kernels.feedback import feedback_factors
    from kvplan.runtime import cache as cache_module

    _, fb = _plans(model)
    calls = []
    monkeypatch.setattr(cache_module, "feedback_factors", lambda m: calls.append(1) or feedback_factors(m))
    states = torch.randn(1, 2, 40, 32, generator=torch.Generator().manual_seed(5))

    def layers_of(plan):
        cache = KVPlanCache(plan, model)
        for layer in cache.layers:
            layer.update(states, states.flip(-1))
        return cache.layers

    first, second = layers_of(fb), layers_of(fb)
    n_layers = len(first)
    assert len(calls) == 2 * n_layers  # k and v of each layer, once
    for a, b in zip(first, second):
        for kind, i in (("k", 0), ("v", 1)):
            assert a.feedback[kind][0] is b.feedback[kind][0] and a.feedback[kind][1] is b.feedback[kind][1]
            fresh = feedback_factors(torch.from_numpy(fb.feedback_metric.array[a.layer_idx, i].astype("float32")))
            assert torch.equal(a.feedback[kind][0], fresh[0]) and torch.equal(a.feedback[kind][1], fresh[1])
    other = fb.replace(feedback_metric=fb.feedback_metric.array.astype("float32") * 2)
    third = layers_of(other)
    assert len(calls) == 4 * n_layers
    assert not torch.equal(third[0].feedback["k"][0], first[0].feedback["k"][0])


@pytest.mark.parametrize("attention", KERNELS)
def test_generation_with_feedback_codes_on_every_route(model, attention):
    """Only the encoder changed: every decode route reads the codes the dequantize route reads."""
    plain, fb = _plans(model, residual_bits=8, recent_length=4)
    out, ref = generate_like_dequantize(model, fb, attention)
    labels = ["text"] * out.cache.get_seq_length()
    assert out.cache.bpv() == fb.bpv(context_len=len(labels), full_precision_bits=32).total
    assert fb.bpv(context_len=len(labels)) == plain.bpv(context_len=len(labels))
