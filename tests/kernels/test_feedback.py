"""Error-feedback encoding (kvplan.kernels.feedback): same scales and decode, lower metric error."""

import pytest
import torch

from kvplan.kernels import dequantize, quantize
from kvplan.kernels.feedback import feedback_factors, quantize_with_feedback
from kvplan.kernels.formats import Format, default_codebook

FORMATS = [
    pytest.param(None, 2, "channel", id="v1-int2-channel"),
    pytest.param(None, 3, "token", id="v1-int3-token"),
    pytest.param(Format(2, "absmax-e4m3", default_codebook(2, "absmax-e4m3", 64)), 2, "token", id="lloyd2-absmax"),
    pytest.param(Format(4, "minmax-e4m3"), 4, "channel", id="int4-minmax-e4m3"),
]


def _skewed_metric(h: int, D: int, seed: int) -> torch.Tensor:
    """SPD metrics [h, D, D] with a few dominant directions (like queries' second moments)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(h, D, 4, generator=g) * torch.tensor([8.0, 4.0, 2.0, 1.0])
    m = a @ a.transpose(-1, -2) + 0.1 * torch.eye(D)
    return m / torch.diagonal(m, dim1=-2, dim2=-1).mean(-1)[:, None, None]


def _metric_error(x, read, metric):
    e = (x - read).float()  # [B, h, T, D]
    return torch.einsum("bhtd,hde,bhte->", e, metric, e).item()


@pytest.mark.parametrize("fmt,bits,axis", FORMATS)
def test_feedback_keeps_the_scales_and_lowers_the_metric_error(fmt, bits, axis):
    """Same scale / zero tensors as nearest-level codes (so the same bytes), codes every decode route
    reads with the format's own dequantize, and a lower e^T M e under a skewed metric."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 40, 64, generator=g)
    metric = _skewed_metric(3, 64, 2)
    plain = quantize(x, bits, 32, axis, 5 if axis == "channel" else 0, fmt=fmt)
    fb = quantize_with_feedback(x, bits, 32, axis, 5 if axis == "channel" else 0, *feedback_factors(metric), fmt=fmt)
    assert fb[0].shape == plain[0].shape and fb[0].dtype == plain[0].dtype
    torch.testing.assert_close(fb[1], plain[1], rtol=0, atol=0)
    assert (fb[2] is None) == (plain[2] is None)
    if fb[2] is not None:
        torch.testing.assert_close(fb[2], plain[2], rtol=0, atol=0)
    offset = 5 if axis == "channel" else 0

    def read(q):
        return dequantize(q[0], q[1], q[2], bits, 32, axis, 64, offset, torch.float32, fmt)

    assert _metric_error(x, read(fb), metric) < 0.8 * _metric_error(x, read(plain), metric)


def test_identity_metric_gives_nearest_level_codes():
    """With M = I nothing is pushed onward: the codes are the nearest levels (ties aside)."""
    x = torch.randn(1, 2, 33, 64, generator=torch.Generator().manual_seed(3))
    fmt = Format(2, "absmax-e4m3", default_codebook(2, "absmax-e4m3", 64))
    plain = quantize(x, 2, 64, "token", fmt=fmt)
    fb = quantize_with_feedback(x, 2, 64, "token", 0, *feedback_factors(torch.eye(64).expand(2, 64, 64)), fmt=fmt)
    assert torch.equal(fb[0], plain[0])


def test_factors_code_the_heaviest_coordinates_first():
    metric = torch.diag(torch.arange(1.0, 9.0)).expand(2, 8, 8).clone()
    U, order = feedback_factors(metric)
    assert order.tolist() == [list(range(7, -1, -1))] * 2
    # U is the upper Cholesky factor of the permuted metric's inverse
    perm = metric[0][order[0]][:, order[0]]
    torch.testing.assert_close(U[0].T @ U[0], torch.linalg.inv(perm), rtol=1e-5, atol=1e-6)
    assert torch.equal(U[0], torch.triu(U[0]))


@pytest.mark.parametrize("fmt,bits,axis", [*FORMATS, pytest.param(None, 8, "token", id="v1-int8-token")])
@pytest.mark.parametrize("D", [64, 256])
def test_native_loop_gives_the_torch_loops_codes(fmt, bits, axis, D, monkeypatch):
    """The C coding loop (CPU, when the native kernels build) and the PyTorch one choose the same codes,
    bit for bit, zero-scale groups included (a constant channel, an all-zero token)."""
    from kvplan.kernels import native_unavailable

    why = native_unavailable(D)
    if why is not None:
        pytest.skip(f"native kernels unavailable: {why}")
    g = torch.Generator().manual_seed(D + bits)
    x = torch.randn(2, 3, 45, D, generator=g) * 3
    x[:, 1, :, 5] = 0.7
    x[:, 2, 7, :] = 0.0
    metric = _skewed_metric(3, D, 5)
    args = (x, bits, 32, axis, 5 if axis == "channel" else 0, *feedback_factors(metric))
    native = quantize_with_feedback(*args, fmt=fmt)
    monkeypatch.setenv("KVPLAN_DISABLE_NATIVE", "1")
    torch_loop = quantize_with_feedback(*args, fmt=fmt)
    assert torch.equal(native[0], torch_loop[0])
