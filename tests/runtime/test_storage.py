"""PackedBlock views: token ranges / chunks and head runs decode exactly as the whole block."""

from __future__ import annotations

import pytest
import torch

from kvplan.runtime.storage import PackedBlock

BLOCKS = {
    # id: (bits, axis, start position -> channel start_offset = start % 32, tokens)
    "int2-channel-midgroup": (2, "channel", 37, 150),
    "int3-channel-aligned": (3, "channel", 64, 96),
    "int4-token": (4, "token", 5, 77),
    "fp16-block": (16, "channel", 3, 40),
}


@pytest.mark.parametrize("spec", list(BLOCKS.values()), ids=list(BLOCKS))
@pytest.mark.parametrize("chunk", [32, 64, 128])
def test_token_chunks_decode_like_the_block(spec, chunk):
    bits, axis, start, T = spec
    x = torch.randn(2, 3, T, 64, generator=torch.Generator().manual_seed(T))
    block = PackedBlock.encode(x, (0, 1, 2), bits, axis, 32, start)
    whole = block.decode(torch.float32)
    pieces = list(block.token_chunks(chunk))
    assert pieces[0][0] == 0 and pieces[-1][1] == T
    assert all(b1 == a2 for (_, b1, _), (a2, _, _) in zip(pieces, pieces[1:]))
    if axis == "channel" and bits < 16:  # every chunk but the first starts on a group boundary
        assert all((block.start_offset + a) % 32 == 0 for a, _, _ in pieces[1:])
        assert len(pieces) == -(-(block.start_offset + T) // chunk)
    assert torch.equal(torch.cat([p.decode(torch.float32) for _, _, p in pieces], dim=2), whole)


def test_channel_token_range_must_start_on_a_group():
    block = PackedBlock.encode(torch.randn(1, 1, 70, 64), (0,), 2, "channel", 32, 0)
    with pytest.raises(ValueError, match="group boundary"):
        block.token_range(10, 40)
    with pytest.raises(ValueError, match="outside"):
        block.token_range(0, 71)


def test_head_runs_split_scattered_heads():
    x = torch.randn(1, 3, 20, 64)
    block = PackedBlock.encode(x, (0, 2, 3), 4, "token", 32, 0)
    runs = [(h0, h1) for h0, h1, _ in block.head_runs()]
    assert runs == [(0, 1), (2, 4)]
    whole = block.decode(torch.float32)
    parts = torch.cat([b.decode(torch.float32) for _, _, b in block.head_runs()], dim=1)
    assert torch.equal(parts, whole)


GROWTH = {
    # id: (bits, axis, tokens per append)
    "int2-channel-g32": (2, "channel", 32),
    "int4-token-odd": (4, "token", 7),
    "fp16-block": (16, "channel", 32),
}


@pytest.mark.parametrize("spec", list(GROWTH.values()), ids=list(GROWTH))
def test_appends_grow_in_place_and_count_stored_bytes(spec):
    """Many appends decode like one encode of all tokens; the buffers behind the block are
    reallocated O(log n) times (capacity grows by 1.5x), not once per append; bytes count the
    stored tokens exactly."""
    bits, axis, n = spec
    steps = 60
    x = torch.randn(2, 3, n * (steps + 1), 64, generator=torch.Generator().manual_seed(n))
    whole = PackedBlock.encode(x, (0, 1, 2), bits, axis, 32, 0)
    block = PackedBlock.encode(x[:, :, :n], (0, 1, 2), bits, axis, 32, 0)
    pointers = set()
    for i in range(1, steps + 1):
        block.append(PackedBlock.encode(x[:, :, i * n : (i + 1) * n], (0, 1, 2), bits, axis, 32, i * n))
        pointers.add(block.codes.data_ptr())
    assert block.length == whole.length
    assert torch.equal(block.decode(torch.float32), whole.decode(torch.float32))
    assert block.nbytes_parts() == whole.nbytes_parts()
    assert len(pointers) <= 12  # 1.5x growth from n to 61 n tokens: about log_1.5(61) = 10 reallocations
    block.map_tensors(lambda t: t[[1, 0]])  # replaced tensors: the next append starts a new buffer
    block.append(PackedBlock.encode(x[:, :, :n], (0, 1, 2), bits, axis, 32, block.length))
    assert torch.equal(block.decode(torch.float32)[:, :, : whole.length], whole.decode(torch.float32)[[1, 0]])


@pytest.mark.parametrize("bits", [16, 8])
def test_a_residual_cropped_keeps_no_bytes_of_the_dropped_tokens(bits):
    """``drop_newest`` (``Cache.crop``) kept the uncoded tokens as a view of the longer tensor: the dropped
    tokens' bytes stayed alive, uncounted, until the next write."""
    from kvplan.runtime.storage import Residual

    x = torch.randn(1, 2, 40, 64)
    r = Residual(bits, 32, x[:, :, :0].clone())
    r.append(x[:, :, :24])
    r.seal()
    r.append(x[:, :, 24:])
    r.drop_newest(10)
    assert r.length == 30 and torch.equal(r.read()[:, :, 24:], x[:, :, 24:30])
    assert r.fresh.untyped_storage().nbytes() == r.fresh.numel() * r.fresh.element_size()
