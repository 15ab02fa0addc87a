"""Decode attention over the packed cache with native CPU loops (the CPU default when a C compiler is present).

Same signature and result as :func:`kvplan.kernels.attention_chunked.chunked_decode_attention`
(it shares its driver, :func:`~kvplan.kernels.attention_chunked.packed_attention`: one score
tensor, the mask, one softmax, the values' Hadamard applied once to the output); only the two
per-token loops differ. They run in C (``kernels/native/attention_cpu.c``, built at first use
by :mod:`kvplan.kernels.native_build`), one call per run of consecutive KV heads of a packed
block, all its tokens at once:

- **key scores**: 16 tokens at a time are decoded from their packed codes into a channel-major
  tile, un-Hadamarded there by a fast Walsh-Hadamard transform (``D log D`` adds per key), turned
  by RoPE at their own cache indices when stored in the pre-RoPE frame, and dotted with the query
  rows. The chunked PyTorch kernel does the same algebra with whole-chunk tensor ops (a byte table
  gather, a ``[C, D] x [D, D]`` product, a complex product), each a full pass over a chunk-sized
  buffer; here a tile never leaves the L1 cache. Keys stored times ``H`` without the pre-RoPE
  frame are dotted with the query rotated once (``q·(ŷ H) = (q H)·ŷ``), and the key correction
  adds ``(q U)·ẑ`` with the same loop on the ``r``-channel correction code (``k̂ + U ẑ`` is never
  built);
- **values**: each token's row is decoded and added, weighted by its probabilities, into the
  output rows (``acc += p_t · v_t``); values stored times ``H`` are accumulated in the rotated
  frame and rotated once by the driver.

Full-precision blocks (16-bit slots) are read by the same torch product as in the chunked kernel.
Head dims up to :data:`MAX_HEAD_DIM` (the C tiles are stack arrays). With ``torch.get_num_threads()``
above 1, long runs are split into token chunks run on that many threads (:class:`NativePieces`).
"""

from __future__ import annotations

import functools
import math
from concurrent.futures import ThreadPoolExecutor

import torch

from .attention_chunked import packed_attention
from .native_build import NativeUnavailable, native_library

__all__ = ["MAX_HEAD_DIM", "NativeUnavailable", "native_decode_attention", "native_supports"]

MAX_HEAD_DIM = 256  # MAX_D in attention_cpu.c
_SUPPORTED_BITS = (2, 3, 4, 8)


def native_supports(head_dim: int) -> str | None:
    """Why the native kernel cannot serve a model with this head_dim (``None``: it can)."""
    if head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim} is above the native kernel's {MAX_HEAD_DIM}"
    return None


@functools.lru_cache(maxsize=None)
def _levels(bits: int, fmt) -> torch.Tensor:
    """fp32 ``L [2**bits]``: the level of each code (the codes themselves for uniform min-max)."""
    levels = None if fmt is None else fmt.level_units("cpu")
    return (torch.arange(1 << bits, dtype=torch.float32) if levels is None else levels).contiguous()


@functools.lru_cache(maxsize=None)
def _byte_lut(bits: int, fmt) -> torch.Tensor:
    """fp32 level table the C loops read codes through: per byte value the levels of the codes
    it packs (2 bits: ``[256, 4]``, 4: ``[256, 2]``, 8: ``[256]``), or the 8 levels (3 bits)."""
    levels = _levels(bits, fmt)
    if bits == 3:
        return levels
    b = torch.arange(256)
    codes = torch.stack([(b >> (j * bits)) & ((1 << bits) - 1) for j in range(8 // bits)], dim=-1)
    return levels[codes].contiguous()


def _uniform(piece) -> int:
    """1 when the piece's levels are its codes (``L[c] = c``: the v1 format and uniform min-max)."""
    return int(piece.fmt is None or piece.fmt.level_units("cpu") is None)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


# a head run of at least this many token-heads (x batch) is split over torch's intra-op threads
MIN_TOKENS_PER_THREAD = 2048

_POOL: list = [None, 0]  # (ThreadPoolExecutor, its size)


def _pool(n: int) -> ThreadPoolExecutor:
    if _POOL[1] != n:
        if _POOL[0] is not None:
            _POOL[0].shutdown(wait=False)
        _POOL[0], _POOL[1] = ThreadPoolExecutor(max_workers=n, thread_name_prefix="kvplan-native"), n
    return _POOL[0]


class NativePieces:
    """How :func:`packed_attention` reads packed blocks in the native kernel: one C call per head
    run, or -- with ``torch.get_num_threads() > 1`` and a long run -- one per token chunk (whole
    token groups), run on a thread pool (ctypes releases the GIL during a call). The calls of one
    phase are queued and run by :meth:`finish`; everything they read is prepared on the calling
    thread (tables grown, scales converted), so the workers only run C loops on disjoint outputs
    (values: each call into its own partial sum, added in queue order afterwards, so a run's result
    does not depend on which worker finishes first)."""

    def __init__(self, lib):
        self.lib = lib
        self.threads = max(1, torch.get_num_threads())
        self.queue = []  # (call, partial sum or None, its target)

    @staticmethod
    def pieces(blocks, B: int, D: int):
        for block in blocks:
            for h0, h1, run in block.head_runs():
                yield h0, h1, 0, run.length, run

    @staticmethod
    def rotated_query(qg: torch.Tensor, key_blocks) -> torch.Tensor | None:
        """The query rotated keys are dotted with: ``qg H`` (Hadamard without the pre-RoPE frame);
        ``qg / sqrt(D)`` for pre-RoPE keys with a Hadamard (the C transform is unnormalized);
        ``qg`` for pre-RoPE keys alone; ``None`` when no key block is rotated."""
        for blocks in key_blocks:
            for block in blocks:
                rot = block.rotation
                if rot is not None:
                    if rot.inv_freq is None:
                        return torch.matmul(qg, rot.hadamard)
                    return qg if rot.hadamard is None else qg * (1.0 / math.sqrt(qg.shape[-1]))
        return None

    def _chunks(self, piece):
        """``(a, b, part)``: the whole run, or token chunks of whole groups for the thread pool."""
        size = piece.length * len(piece.heads) * piece.codes.shape[0]
        n = min(self.threads, size // MIN_TOKENS_PER_THREAD)
        if n <= 1:
            return [(0, piece.length, piece)]
        g = piece.group_size
        chunk = -(-piece.length // (n * g)) * g
        return list(piece.token_chunks(chunk))

    def _run_args(self, piece, rows: int):
        """The C arguments describing one packed run read by ``rows`` query rows: shapes, codes,
        level table, scales."""
        if piece.bits not in _SUPPORTED_BITS:
            raise ValueError(f"the native kernel reads {_SUPPORTED_BITS}-bit codes, not {piece.bits}")
        if piece.head_dim > MAX_HEAD_DIM:
            raise ValueError(native_supports(piece.head_dim))
        codes = piece.codes
        if codes.stride(-1) != 1:
            codes = codes.contiguous()
        scale = piece.scale.float()
        zero = None if piece.zero is None else piece.zero.float()
        if scale.stride(-1) != 1 or (zero is not None and zero.stride() != scale.stride()):
            scale = scale.contiguous()
            zero = None if zero is None else zero.contiguous()
        B, h, T = codes.shape[:3]
        channel = piece.axis == "channel"
        group = piece.group_size if channel else piece.head_dim // scale.shape[-1]
        lut = _byte_lut(piece.bits, piece.fmt)
        keep = (codes, scale, zero, lut)  # alive until the call returns
        args = [B, h, T, piece.head_dim, rows, _ptr(codes), *codes.stride()[:3], piece.bits, _ptr(lut), _ptr(scale),
                _ptr(zero), *scale.stride()[:3], int(channel), group, piece.start_offset]
        return args, keep

    def key_scores(self, piece, qg, q_rot, out) -> None:
        """Queue the scores of one head run's keys into ``out [B, h, R, T]`` (see the module docstring)."""
        if piece.scale is None:  # full precision
            torch.matmul(qg, piece.codes.float().transpose(-1, -2), out=out)
            return
        rot = piece.rotation
        q = qg if rot is None else q_rot
        q = q if q.stride(-1) == 1 else q.contiguous()
        qu = None if piece.correction is None else torch.matmul(qg, piece.basis)  # [B, h, R, r]
        hadamard = int(rot is not None and rot.inv_freq is not None and rot.hadamard is not None)
        half = 0 if rot is None or rot.inv_freq is None else rot.inv_freq.shape[0]
        shift = rot.row_shift if half else None  # int64 [B]: a left-padded batch's rows at their own positions
        if half:  # grow the tables here, not in a worker
            rot.angles_by_pair(piece.position, piece.length + rot.max_shift)
        for a, b, part in self._chunks(piece):
            cos_t = sin_t = None
            if half:
                cos_t, sin_t = rot.angles_by_pair(part.position, part.length + rot.max_shift)  # [half, T'] views
            args, keep = self._run_args(part, q.shape[2])
            o = out[..., a:b]
            calls = [(self.lib.kvp_key_scores, [*args, _ptr(q), *q.stride()[:3], hadamard, half, _ptr(cos_t),
                                                _ptr(sin_t), 0 if cos_t is None else cos_t.stride(0), _ptr(shift),
                                                _ptr(o), *o.stride()[:3], 0, _uniform(part)])]
            if qu is not None:  # + (q U)·ẑ: the same loop on the r-channel code, added after the scores
                cargs, ckeep = self._run_args(part.correction, qu.shape[2])
                keep = (keep, ckeep)
                calls.append((self.lib.kvp_key_scores, [*cargs, _ptr(qu), *qu.stride()[:3], 0, 0, None, None, 0,
                                                        None, _ptr(o), *o.stride()[:3], 1, _uniform(part.correction)]))
            self.queue.append((calls, (keep, q, qu, cos_t, sin_t, shift, o), None, None))

    def value_add(self, piece, probs, acc) -> None:
        """Queue ``acc [B, h, R, D] += probs [B, h, R, T] @ v`` of one head run's values as stored."""
        if piece.scale is None:
            acc.add_(torch.matmul(probs, piece.codes.float()))
            return
        if probs.stride(-1) != 1:
            probs = probs.contiguous()
        levels = _levels(piece.bits, piece.fmt)
        chunks = self._chunks(piece)
        # one thread runs the queue in order, so its calls may add into acc itself; on the thread pool
        # every call gets its own partial sum: the runs of successive segments read into the same acc
        # rows, and two C loops adding into one row at once would race (lost updates, and an order
        # that changes run to run)
        in_place = self.threads == 1
        for a, b, part in chunks:
            args, keep = self._run_args(part, probs.shape[2])
            p = probs[..., a:b]
            target = acc if in_place else torch.zeros_like(acc)
            call = (self.lib.kvp_value_accum, [*args, _ptr(p), *p.stride()[:3], _ptr(target), *target.stride()[:3],
                                               _ptr(levels), _uniform(part)])
            self.queue.append(([call], (keep, p, levels), None if target is acc else target, acc))

    def finish(self) -> None:
        """Run the queued calls (on the thread pool when there are several), then add the values'
        partial sums in queue order."""
        queue, self.queue = self.queue, []
        if not queue:
            return

        def run(calls):
            for fn, args in calls:
                fn(*args)

        if self.threads > 1 and len(queue) > 1:
            for f in [_pool(self.threads).submit(run, calls) for calls, *_ in queue]:
                f.result()
        else:
            for calls, *_ in queue:
                run(calls)
        for _, _, partial, target in queue:
            if partial is not None:
                target.add_(partial)


def native_decode_attention(
    q: torch.Tensor,
    key_blocks,
    value_blocks,
    key_residual: torch.Tensor | None,
    value_residual: torch.Tensor | None,
    attn_mask: torch.Tensor | None = None,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """:func:`~kvplan.kernels.attention_chunked.chunked_decode_attention` with the native CPU
    loops (CPU tensors only); raises :class:`NativeUnavailable` when they cannot be built here."""
    if q.is_cuda:
        raise ValueError("the native decode attention runs on CPU tensors; CUDA caches use the Triton kernel")
    return packed_attention(q, key_blocks, value_blocks, key_residual, value_residual, attn_mask, sm_scale,
                            NativePieces(native_library()))
