"""Hadamard and pre-RoPE rotations of the codec (kvplan.kernels.rotation)."""

from __future__ import annotations

import pytest
import torch

from kvplan.kernels.rotation import Rotation, hadamard_matrix, rope_rotate


def _inv_freq(d, theta=10000.0):
    return 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)


def test_hadamard_is_symmetric_orthogonal_and_needs_a_power_of_two():
    H = hadamard_matrix(64)
    torch.testing.assert_close(H, H.T)
    torch.testing.assert_close(H @ H, torch.eye(64), atol=1e-6, rtol=0)
    assert torch.allclose(H.abs(), torch.full((64, 64), 1 / 8))
    with pytest.raises(ValueError, match="power-of-two head_dim, got 48"):
        hadamard_matrix(48)


def test_rope_rotate_undoes_the_models_rope():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    D, T, p0 = 32, 50, 1000
    inv = _inv_freq(D)
    k = torch.randn(2, 3, T, D, generator=torch.Generator().manual_seed(0))
    t = torch.arange(p0, p0 + T, dtype=torch.float32)
    emb = torch.cat([torch.outer(t, inv)] * 2, dim=-1)
    _, k_rope = apply_rotary_pos_emb(k, k, emb.cos()[None], emb.sin()[None])  # the model's RoPE at p0..
    torch.testing.assert_close(rope_rotate(k_rope, p0, inv, -1.0), k, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(rope_rotate(k, p0, inv, 1.0), k_rope, atol=1e-4, rtol=1e-4)


def test_partial_rotary_leaves_the_other_channels_alone():
    x = torch.randn(1, 2, 10, 16)
    y = rope_rotate(x, 3, _inv_freq(8), -1.0)  # rotary on the first 8 channels only
    assert torch.equal(y[..., 8:], x[..., 8:])
    assert not torch.allclose(y[..., :8], x[..., :8])


@pytest.mark.parametrize("parts", ["hadamard", "rope", "both"])
def test_inverse_undoes_forward_at_any_position(parts):
    D = 64
    rot = Rotation(hadamard_matrix(D) if parts != "rope" else None, _inv_freq(D) if parts != "hadamard" else None)
    x = torch.randn(2, 3, 70, D, generator=torch.Generator().manual_seed(1))
    for position in (0, 37, 100_000):
        y = rot.forward(x, position)
        assert not torch.allclose(y, x)
        torch.testing.assert_close(rot.inverse(y, position), x, atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        Rotation()
