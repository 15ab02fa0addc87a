"""Native CPU decode attention (C loops built at first use) against the PyTorch reference."""

from __future__ import annotations

import contextlib

import pytest
import torch

import kvplan
from kvplan import kernels
from kvplan.kernels import decode_attention, native_build
from kvplan.kernels.attention_native import native_decode_attention
from kvplan.kernels.attention_reference import reference_decode_attention
from kvplan.kernels.formats import Format, default_codebook
from kvplan.kernels.rotation import Rotation, hadamard_matrix
from kvplan.runtime.storage import PackedBlock
from tests.kernels.attention_cases import ATTN_CASES, assert_matches_reference, rand


@pytest.mark.parametrize("case", list(ATTN_CASES.values()), ids=list(ATTN_CASES))
def test_native_matches_reference(case):
    assert_matches_reference(native_decode_attention, case)


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op threads set to ``n`` inside the block (the native kernel's pool follows them)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _inv_freq(d):
    return 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)


# Long runs: many 16-token tiles, token groups that end inside a tile (start offsets 0 / 5 / 100
# against groups of 32 / 128), a short last tile; every width, uniform and codebook levels, both
# axes, both scalings, head dims 64 / 128 / 256, up to 9 query rows per KV head (the C loops
# take query rows four at a time).
LONG = [
    # (bits, key format, value format, key axis, group, start, T, D, n_rep, Tq)
    (2, None, None, "channel", 128, 0, 1000, 64, 3, 1),
    (2, None, "absmax", "channel", 128, 5, 777, 64, 3, 1),
    (4, None, "absmax", "channel", 32, 100, 301, 128, 9, 1),
    (3, None, None, "channel", 32, 5, 250, 64, 2, 3),
    (8, None, "absmax", "channel", 128, 0, 200, 256, 4, 1),
    (2, "minmax", "absmax", "channel", 32, 7, 333, 64, 5, 1),
    (4, None, None, "token", 32, 0, 97, 64, 1, 2),
    (2, None, None, "token", 32, 3, 130, 256, 2, 1),
]


def _fmt(kind, bits, axis, group, D):
    if kind is None:
        return None
    scaling = "minmax-e4m3" if kind == "minmax" else "absmax-e4m3"
    glen = group if axis == "channel" else min(group, D)
    return Format(bits, scaling, default_codebook(bits, scaling, glen) if bits <= 4 else None)


@pytest.mark.parametrize("spec", LONG, ids=[f"{s[0]}b-{s[3]}-g{s[4]}-s{s[5]}-T{s[6]}-D{s[7]}-R{s[8] * s[9]}"
                                              for s in LONG])
@pytest.mark.parametrize("codec", ["plain", "H", "H+rope", "rope+corr"])
def test_native_long_runs(spec, codec):
    bits, kf, vf, axis, group, start, T, D, n_rep, Tq = spec
    if "corr" in codec and axis != "channel":
        pytest.skip("the key correction needs channel-axis keys")
    H = hadamard_matrix(D) if "H" in codec else None
    inv = _inv_freq(D) if "rope" in codec else None
    k_rot = None if H is None and inv is None else Rotation(H, inv)
    v_rot = None if H is None else Rotation(H)
    Hkv, B = 2, 2
    basis = torch.linalg.qr(torch.randn(Hkv, D, D, generator=torch.Generator().manual_seed(1)))[0][..., :2]
    k = rand((B, Hkv, T, D), torch.float32, seed=3)
    v = rand((B, Hkv, T, D), torch.float32, seed=4, scale=0.5)
    kb = [[PackedBlock.encode(k, (0, 1), bits, axis, group, start, basis.contiguous() if "corr" in codec else None,
                              rotation=k_rot, fmt=_fmt(kf, bits, axis, group, D))]]
    vb = [[PackedBlock.encode(v, (0, 1), bits, "token", group, start, rotation=v_rot,
                              fmt=_fmt(vf, bits, "token", group, D))]]
    q = rand((B, Hkv * n_rep, Tq, D), torch.float32, seed=5, scale=0.5)
    ref = reference_decode_attention(q, kb, vb, None, None)
    out = native_decode_attention(q, kb, vb, None, None)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_native_reads_views_of_growing_blocks():
    """A block grown by commits is a view of a larger capacity buffer (strided codes and scales)."""
    D, rot = 64, Rotation(hadamard_matrix(64), _inv_freq(64))
    k = rand((1, 3, 200, D), torch.float32, seed=8)
    v = rand((1, 3, 200, D), torch.float32, seed=9)
    kb = PackedBlock.encode(k[:, :, :64], (0, 1, 2), 2, "channel", 32, 0, rotation=rot)
    vb = PackedBlock.encode(v[:, :, :64], (0, 1, 2), 2, "token", 32, 0, rotation=Rotation(hadamard_matrix(D)))
    for a in range(64, 200, 32):
        b = min(a + 32, 200)
        kb.append(PackedBlock.encode(k[:, :, a:b], (0, 1, 2), 2, "channel", 32, a, rotation=kb.rotation))
        vb.append(PackedBlock.encode(v[:, :, a:b], (0, 1, 2), 2, "token", 32, a, rotation=vb.rotation))
    assert not kb.codes.is_contiguous() and not vb.scale.is_contiguous()
    q = rand((1, 9, 1, D), torch.float32, seed=10)
    ref = reference_decode_attention(q, [[kb]], [[vb]], None, None)
    torch.testing.assert_close(native_decode_attention(q, [[kb]], [[vb]], None, None), ref, atol=1e-4, rtol=1e-4)


def test_dispatcher_uses_native_on_cpu():
    assert kernels.decode_attention_kernel(cuda=False, head_dim=64) is native_decode_attention
    q = rand((1, 2, 1, 64), torch.float32, seed=4)
    k = rand((1, 1, 40, 64), torch.float32, seed=5)
    kb = [[PackedBlock.encode(k, (0,), 2, "channel", 32, 0)]]
    vb = [[PackedBlock.encode(k, (0,), 2, "token", 32, 0)]]
    assert torch.equal(decode_attention(q, kb, vb, None, None), native_decode_attention(q, kb, vb, None, None))


def test_head_dim_past_the_tiles_is_refused():
    D = 512
    kb = [[PackedBlock.encode(torch.randn(1, 1, 8, D), (0,), 2, "channel", 32, 0)]]
    vb = [[PackedBlock.encode(torch.randn(1, 1, 8, D), (0,), 2, "token", 32, 0)]]
    with pytest.raises(ValueError, match="head_dim 512 is above the native kernel's 256"):
        native_decode_attention(torch.randn(1, 1, 1, D), kb, vb, None, None)
    assert "head_dim 512" in kernels.native_unavailable(D)


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    """As on a machine without a C compiler: a fresh build attempt with a compiler that is not there."""
    monkeypatch.setenv("KVPLAN_CC", "kvplan-no-such-cc")
    monkeypatch.setenv("KVPLAN_CACHE_DIR", str(tmp_path))
    native_build.native_library.cache_clear()
    kernels._warn_chunked_once.cache_clear()
    yield
    native_build.native_library.cache_clear()
    kernels._warn_chunked_once.cache_clear()


def test_no_compiler_is_said_not_hidden(no_compiler):
    from tests.tiny_models import tiny_llama

    with pytest.raises(native_build.NativeUnavailable, match="no C compiler: 'kvplan-no-such-cc'"):
        native_build.native_library()
    model = tiny_llama()
    with pytest.raises(kvplan.PlanError, match="native CPU kernel unavailable: no C compiler"):
        kvplan.load(model, "int4", attention="native")
    with pytest.warns(RuntimeWarning, match="native CPU decode attention is not available .*no C compiler.*chunked"):
        kvplan.load(model, "int4")  # auto: the chunked kernel, said once
    assert model._kvplan_attention_kernel.__name__ == "chunked_decode_attention"
    kvplan.unload(model)


def test_build_is_cached_on_disk(monkeypatch, tmp_path):
    monkeypatch.setenv("KVPLAN_CACHE_DIR", str(tmp_path))
    native_build.native_library.cache_clear()
    try:
        lib = native_build.native_library()
        built = list((tmp_path / "native").glob("attention_cpu-*.so"))
        assert len(built) == 1 and lib._name == str(built[0])
        assert not [p for p in (tmp_path / "native").iterdir() if p.suffix == ".so" and p not in built]
    finally:
        native_build.native_library.cache_clear()


@pytest.mark.parametrize("codec", ["H+rope+corr", "plain"])
def test_threads_split_runs_into_token_chunks(codec, monkeypatch):
    """With several torch threads a long run is split into token chunks (whole groups) run on a
    thread pool; the result is the reference's, as with one thread."""
    from kvplan.kernels import attention_native

    monkeypatch.setattr(attention_native, "MIN_TOKENS_PER_THREAD", 16)
    D, B, Hkv, T, group = 64, 2, 3, 301, 32
    rot = Rotation(hadamard_matrix(D), _inv_freq(D)) if codec != "plain" else None
    basis = torch.linalg.qr(torch.randn(Hkv, D, D, generator=torch.Generator().manual_seed(1)))[0][..., :2]
    k = rand((B, Hkv, T, D), torch.float32, seed=3)
    v = rand((B, Hkv, T, D), torch.float32, seed=4, scale=0.5)
    fmt = Format(2, "absmax-e4m3", default_codebook(2, "absmax-e4m3", 32))
    kb = [[PackedBlock.encode(k[:, :2], (0, 1), 2, "channel", group, 5, basis[:2].contiguous() if rot else None,
                              rotation=rot),
           PackedBlock.encode(k[:, 2:], (2,), 4, "channel", group, 5, rotation=rot)]]
    vb = [[PackedBlock.encode(v, (0, 1, 2), 2, "token", group, 5, fmt=fmt,
                              rotation=None if rot is None else Rotation(hadamard_matrix(D)))]]
    q = rand((B, Hkv * 3, 1, D), torch.float32, seed=5, scale=0.5)
    ref = reference_decode_attention(q, kb, vb, None, None)
    with torch_threads(1):
        one = native_decode_attention(q, kb, vb, None, None)
    with torch_threads(3):
        reader = attention_native.NativePieces(native_build.native_library())
        assert len(reader._chunks(kb[0][0])) == 3  # the run is split
        many = native_decode_attention(q, kb, vb, None, None)
    torch.testing.assert_close(one, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(many, one, atol=1e-6, rtol=1e-6)


def test_threads_add_each_value_run_into_its_own_partial_sum():
    """On the thread pool the value runs of successive segments read into the same output rows: each
    call adds into its own partial sum, summed in queue order afterwards, so a decode step gives the
    same result on every run (two C loops adding into one row at once lose updates, and their order
    changed from run to run: the default model's logits moved by up to 0.15 over 32 steps)."""
    from kvplan.kernels import attention_native

    D, B, Hkv, group, n_segments = 64, 2, 3, 32, 24
    heads = tuple(range(Hkv))
    k = rand((B, Hkv, n_segments * group, D), torch.float32, seed=6)
    v = rand((B, Hkv, n_segments * group, D), torch.float32, seed=7, scale=0.5)
    kb = [[PackedBlock.encode(k[:, :, i * group:(i + 1) * group], heads, 2, "channel", group, i * group)]
          for i in range(n_segments)]
    vb = [[PackedBlock.encode(v[:, :, i * group:(i + 1) * group], heads, 2, "token", group, i * group)]
          for i in range(n_segments)]
    q = rand((B, Hkv * 3, 1, D), torch.float32, seed=8, scale=0.5)
    with torch_threads(1):
        one = native_decode_attention(q, kb, vb, None, None)
    with torch_threads(2):
        reader = attention_native.NativePieces(native_build.native_library())
        acc = torch.zeros(B, Hkv, 3, D)
        probs = torch.full((B, Hkv, 3, group), 1.0 / group)
        reader.value_add(vb[0][0], probs, acc)
        reader.value_add(vb[1][0], probs, acc)
        assert [partial is not None and partial.data_ptr() != acc.data_ptr() for _, _, partial, _ in reader.queue] \
            == [True, True]
        reader.finish()
        runs = [native_decode_attention(q, kb, vb, None, None) for _ in range(20)]
    assert all(torch.equal(r, runs[0]) for r in runs)
    torch.testing.assert_close(runs[0], one, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(one, reference_decode_attention(q, kb, vb, None, None), atol=1e-4, rtol=1e-4)


def test_unwritable_build_folder_is_said(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("KVPLAN_CACHE_DIR", str(blocker))  # a file: no folder can be made under it
    native_build.native_library.cache_clear()
    try:
        with pytest.raises(native_build.NativeUnavailable, match="cannot write the build folder .*KVPLAN_CACHE_DIR"):
            native_build.native_library()
    finally:
        native_build.native_library.cache_clear()
