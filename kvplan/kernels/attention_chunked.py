"""Decode attention over the packed cache in token chunks (PyTorch, any device; ``attention="chunked"``).

The CPU default is the native kernel (:mod:`kvplan.kernels.attention_native`), which runs the
same driver (:func:`packed_attention`) with C loops in place of this module's chunk-sized tensor
ops; this kernel is the CPU route where no C compiler is present, and a readable second
implementation of the same algebra. A streamed head's blocks (bits 0) store nothing: their
positions get no weight.

Same signature as :func:`kvplan.kernels.triton_kernels.packed_decode_attention` and
:func:`kvplan.kernels.attention_reference.reference_decode_attention`, whose result it
reproduces up to fp32 rounding. Instead of assembling the whole dequantized
``[B, H_kv, T, D]`` keys and values (what the dequantize-then-attend path and the
reference do), it dequantizes one chunk of tokens of one packed block at a time into a
small reusable buffer (``CHUNK_BYTES``, sized to stay in the CPU caches) and consumes it
at once:

1. scores: per chunk ``[B, H_kv, n_rep·Tq, C] = q_g @ k_chunkᵀ`` written into one score
   tensor ``[B, H_kv, n_rep·Tq, T_total]`` (GQA: the ``n_rep`` query heads of a KV head
   are stacked as rows, so no key is repeated);
2. one softmax over the full score rows (scores are ``D / n_rep`` times smaller than the
   keys, so no online-softmax rescaling is needed);
3. output: per chunk ``out += p_chunk @ v_chunk``.

The codec's transforms stay off the per-token path where the algebra allows
(DESIGN.md, "Kernel math that belongs on the query side stays there"); a chunk is
dequantized as stored (:meth:`PackedBlock.stored_into`, the rotated frame) and

- values stored times a Hadamard ``H``: their products are summed apart and the sum is
  rotated once, ``sum_j p_j (v̂'_j H) = (sum_j p_j v̂'_j) H``;
- keys times ``H`` without the pre-RoPE frame: the query is rotated once, ``q·(ŷ H) = (q H)·ŷ``;
- the key correction ``k̂ + U ẑ``: ``q·k̂ + (q U)·ẑ``, ``r`` numbers per query row and key;
- keys in the pre-RoPE frame (RoPE is position-dependent and does not commute with ``H``): per
  chunk, ``x' = ŷ H[:, perm]`` into a second reused buffer (``perm`` puts each rotary pair side
  by side), RoPE as one in-place complex product at the chunk's cache indices (``Rotation.cis``,
  a table; six real passes over the chunk took 3x longer), then the dot product with the
  permuted query; post-RoPE keys of more than one chunk never exist. ``H`` is applied as one
  ``[C, D] x [D, D]`` BLAS product: measured on
  this CPU (1 thread, ``[1, 3, 4096, 64]`` fp32) it takes 1.7 ms against 9.9 ms for an
  O(D log D) fast Walsh-Hadamard transform written with torch ops (six butterfly passes, each
  a full-size temporary) and 3.5 ms for ``H_8 ⊗ H_8``, so the product is kept.

Per layer on one CPU thread it is 1.5× faster than dequantizing the whole history first at
a 4k history and batch 8, 3.2× at 16k × 8, and 10-15% slower at 1k × 1
(``bench/results/attention-cpu.md``): the dequantized values never leave the caches.
"""

from __future__ import annotations

import math

import torch

from .qtypes import STREAMED

__all__ = ["CHUNK_BYTES", "ChunkedPieces", "chunked_decode_attention", "packed_attention"]

# fp32 bytes of one dequantized chunk ([B, h, C, D]); about an L2/L3 share per core
CHUNK_BYTES = 4 << 20


def _chunk_tokens(B: int, h: int, D: int, group_size: int) -> int:
    c = CHUNK_BYTES // (4 * B * h * D)
    return max(group_size, c // group_size * group_size)


def _segment_pieces(blocks, B: int, D: int):
    """``(h0, h1, a, b, block)`` for every head run and token chunk of one segment's blocks."""
    for block in blocks:
        for h0, h1, run in block.head_runs():
            for a, b, piece in run.token_chunks(_chunk_tokens(B, h1 - h0, D, run.group_size)):
                yield h0, h1, a, b, piece


def _dequantized(piece, scratch: list, slot: int = 0) -> torch.Tensor:
    """``piece``'s stored codes as fp32 ``[B, h, C, D]`` (:meth:`PackedBlock.stored_into`: in the
    rotated frame, no correction): a view into the reused buffer ``scratch[slot]`` (grown when a
    chunk needs more), or the stored tensor of a full-precision block."""
    if piece.scale is None:
        return piece.codes.float()
    return piece.stored_into(_buffer(scratch, slot, (*piece.codes.shape[:3], piece.head_dim), piece.codes.device))


def _buffer(scratch: list, slot: int, shape, device) -> torch.Tensor:
    n = math.prod(shape)
    if scratch[slot] is None or scratch[slot].numel() < n:
        scratch[slot] = torch.empty(n, dtype=torch.float32, device=device)
    return scratch[slot][:n].view(shape)


def _key_scores(piece, qg, q_rot, scratch, out) -> None:
    """Scores of one key chunk, written into ``out [B, h, R, C]``: ``qg [B, h, R, D]`` (scaled
    queries of the piece's heads) dotted with the keys as the cache reads them.

    - plain: ``qg @ k̂ᵀ``;
    - Hadamard without pre-RoPE: ``(qg H) @ ŷᵀ`` (``q_rot``: the query rotated once per step);
    - pre-RoPE keys: per chunk ``x' = ŷ H[:, perm]`` (one ``[C, D] x [D, D]`` product into a second
      scratch buffer; ``perm`` puts the rotary pairs side by side, ``Rotation.pair_order``), RoPE as
      one in-place complex product with ``cos + i sin`` of the chunk's cache indices, then
      ``qg[..., perm] @ x'ᵀ`` (``q_rot``, permuted once per step);
    - key correction: ``+ (qg U) @ ẑᵀ`` (``r`` numbers per query row; ``k̂ + U ẑ`` is never built).
    """
    y = _dequantized(piece, scratch)  # [B, h, C, D]
    rot = piece.rotation
    if rot is None:
        torch.matmul(qg, y.transpose(-1, -2), out=out)
    elif rot.inv_freq is None:
        torch.matmul(q_rot, y.transpose(-1, -2), out=out)
    else:
        perm, a = rot.pair_order(y.shape[-1])
        x = _buffer(scratch, 1, y.shape, y.device)
        if a is None:
            torch.index_select(y, -1, perm, out=x)
        else:
            torch.matmul(y, a, out=x)
        half = rot.inv_freq.shape[0]
        torch.view_as_complex(x[..., : 2 * half].unflatten(-1, (half, 2))).mul_(rot.cis(piece.position, piece.length))
        torch.matmul(q_rot, x.transpose(-1, -2), out=out)
    if piece.correction is not None:
        z = _dequantized(piece.correction, scratch, 2)  # [B, h, C, r]
        out.add_(torch.matmul(torch.matmul(qg, piece.basis), z.transpose(-1, -2)))


class ChunkedPieces:
    """How :func:`packed_attention` reads packed blocks in the chunked PyTorch kernel: token
    chunks of ``CHUNK_BYTES`` dequantized into reused buffers (see the module docstring)."""

    def __init__(self):
        self.scratch = [None, None, None]  # reused fp32 buffers: stored codes, un-Hadamarded keys, correction

    def pieces(self, blocks, B: int, D: int):
        return _segment_pieces(blocks, B, D)

    def rotated_query(self, qg: torch.Tensor, key_blocks) -> torch.Tensor | None:
        return _rotated_query(qg, key_blocks)

    def key_scores(self, piece, qg, q_rot, out) -> None:
        _key_scores(piece, qg, q_rot, self.scratch, out)

    def value_add(self, piece, probs, acc) -> None:
        """``acc [B, h, R, D] += probs [B, h, R, C] @ v`` of the piece's values as stored."""
        acc.add_(torch.matmul(probs, _dequantized(piece, self.scratch)))

    def finish(self) -> None:
        """Nothing is queued here: every piece is done when its call returns."""


def chunked_decode_attention(
    q: torch.Tensor,
    key_blocks,
    value_blocks,
    key_residual: torch.Tensor | None,
    value_residual: torch.Tensor | None,
    attn_mask: torch.Tensor | None = None,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """``softmax(q kᵀ · sm_scale + mask) v`` over packed segments + residual; ``[B, Hq, Tq, D]`` in ``q.dtype``.

    ``q [B, Hq, Tq, D]``; ``key_blocks`` / ``value_blocks``: per segment (in time order) a list
    of :class:`~kvplan.runtime.storage.PackedBlock` whose heads partition the KV heads;
    residuals ``[B, H_kv, T_r, D]`` or ``None``; ``attn_mask`` additive float or bool (True =
    attend), ``[B or 1, 1 or Hq, Tq, T_total]``. GQA: query head ``j`` reads KV head
    ``j // (Hq // H_kv)``. A fully masked row gives NaN, as softmax does.
    """
    return packed_attention(q, key_blocks, value_blocks, key_residual, value_residual, attn_mask, sm_scale,
                            ChunkedPieces())


def packed_attention(q, key_blocks, value_blocks, key_residual, value_residual, attn_mask, sm_scale, reader):
    """The decode attention of :func:`chunked_decode_attention` with the packed blocks read by
    ``reader`` (:class:`ChunkedPieces`, or the native kernel's reader in
    :mod:`kvplan.kernels.attention_native`): scores of every piece into one score tensor, the
    mask, one softmax, then every piece's values, the Hadamard of rotated values applied once."""
    B, Hq, Tq, D = q.shape
    seg_lengths = [blocks[0].length for blocks in key_blocks if blocks]
    if key_residual is not None:
        Hkv = key_residual.shape[1]
    elif key_blocks:
        Hkv = sum(len(b.heads) for b in key_blocks[0])
    else:
        raise ValueError("no keys to attend to (no segments and no residual)")
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} is not a multiple of Hkv={Hkv}")
    n_rep = Hq // Hkv
    R = n_rep * Tq
    T_res = 0 if key_residual is None else key_residual.shape[2]
    T_total = sum(seg_lengths) + T_res
    if T_total == 0:
        raise ValueError("no keys to attend to (no segments and no residual)")
    scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    qg = (q.float() * scale).reshape(B, Hkv, R, D)  # rows of KV head h: its n_rep query heads x Tq
    q_rot = reader.rotated_query(qg, key_blocks)  # the query rotated once per step, for rotated keys

    scores = torch.empty(B, Hkv, R, T_total, dtype=torch.float32, device=q.device)  # [B, H_kv, n_rep·Tq, T]
    pos = 0
    for blocks in key_blocks:
        if not blocks:
            continue
        for h0, h1, a, b, piece in reader.pieces(blocks, B, D):
            if piece.bits == STREAMED:  # a streamed head's tokens: nothing stored, never attended
                scores[:, h0:h1, :, pos + a : pos + b] = float("-inf")
                continue
            reader.key_scores(piece, qg[:, h0:h1], None if q_rot is None else q_rot[:, h0:h1],
                              scores[:, h0:h1, :, pos + a : pos + b])
        pos += blocks[0].length
    reader.finish()  # a reader may queue its pieces' work (the native one, on threads)
    if T_res:
        torch.matmul(qg, key_residual.float().transpose(-1, -2), out=scores[..., pos:])
    if attn_mask is not None:
        mb, mh = attn_mask.shape[0], attn_mask.shape[1]
        mask = attn_mask.reshape(mb, Hkv, n_rep, Tq, T_total) if mh == Hq else attn_mask.reshape(mb, 1, 1, Tq, T_total)
        s5 = scores.view(B, Hkv, n_rep, Tq, T_total)
        if mask.dtype == torch.bool:
            s5.masked_fill_(~mask, float("-inf"))
        else:
            s5.add_(mask.float())
    probs = torch.softmax(scores, dim=-1)

    # values stored times H: sum p_j (v̂'_j H) = (sum p_j v̂'_j) H, so their products go to out_h,
    # rotated once at the end
    out = torch.zeros(B, Hkv, R, D, dtype=torch.float32, device=q.device)
    out_h, hadamard = None, None
    pos = 0
    for blocks in value_blocks:
        if not blocks:
            continue
        for h0, h1, a, b, piece in reader.pieces(blocks, B, D):
            if piece.bits == STREAMED:
                continue
            acc = out
            if piece.rotation is not None:
                if piece.rotation.inv_freq is not None:
                    raise ValueError("value blocks carry a Hadamard rotation only (no pre-RoPE frame)")
                if out_h is None:
                    out_h, hadamard = torch.zeros_like(out), piece.rotation.hadamard
                acc = out_h
            reader.value_add(piece, probs[:, h0:h1, :, pos + a : pos + b], acc[:, h0:h1])
        pos += blocks[0].length
    reader.finish()
    if T_res:
        out.add_(torch.matmul(probs[..., pos:], value_residual.float()))
    if out_h is not None:
        out.add_(torch.matmul(out_h, hadamard))
    return out.reshape(B, Hq, Tq, D).to(q.dtype)


def _rotated_query(qg: torch.Tensor, key_blocks) -> torch.Tensor | None:
    """The query that rotated key blocks are dotted with (they share the plan's rotation):
    ``qg H`` for keys times a Hadamard ``H`` without the pre-RoPE frame (``q·(ŷ H) = (q H)·ŷ``,
    ``H`` symmetric), ``qg[..., perm]`` for pre-RoPE keys (see :func:`_key_scores`); ``None``
    when no key block is rotated."""
    for blocks in key_blocks:
        for block in blocks:
            rot = block.rotation
            if rot is not None:
                if rot.inv_freq is None:
                    return torch.matmul(qg, rot.hadamard)
                return qg.index_select(-1, rot.pair_order(qg.shape[-1])[0])
    return None
