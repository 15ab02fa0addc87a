"""Honest bits-per-value accounting.

Counts everything the runtime cache stores: packed codes, scales and zero-points (each slot
format's own bytes, :mod:`kvplan.kernels.formats`),
full-precision (16-bit slot) tokens, and the per-token residual (as written, or coded:
``quantizer.residual_bits``): the newest tokens not yet committed and the recent and heavy-hitter
copies (with the heavy copies' positions and scores).

The commit rule (shared with the runtime, so both see the same token layout):
after ``T`` tokens, the oldest ``C(T) = max(0, G * floor((T - R) / G))`` tokens are
committed (quantized), where ``G`` is the plan's group size and ``R`` its residual
length; the rest stay in the residual. ``C`` is independent of how the tokens arrived
(one prefill or token by token). Committed tokens are stored in runs of one modality.

The residual (``T - C`` newest tokens) is held as written (``fp_bytes`` per value) or, with
``quantizer.residual_bits`` 8 or 4, as per-token v1 codes: ``QuantizerSettings.residual_token_bytes``.
With ``quantizer.recent_length`` ``W``, the newest committed tokens also keep such a copy
(:func:`recent_tokens`: at most ``W``, never a sink position or a freed one), counted as residual.
With ``quantizer.heavy_length`` ``n``, each KV head of a full-attention layer keeps such copies of
up to ``n`` committed non-sink tokens (:func:`heavy_tokens`; the ones attended most, see
:mod:`kvplan.runtime.heavy`), counted as residual together with each copy's position and score
(:data:`HEAVY_META_BYTES`).
A streamed KV head (its slots at bits 0, :data:`STREAMED`) stores no codes; it keeps such copies of
its newest ``quantizer.stream_window`` committed non-sink tokens (:func:`stream_tokens`: those the
recent copies do not hold already), counted as residual.

Attention sinks: the first ``S = quantizer.sink_length`` positions of the sequence are
stored in every slot alike when they are committed (:func:`stored_runs` splits a run at ``S``):
as written (``quantizer.sink_bits`` 16, counted like a 16-bit slot) or as 8-bit per-token codes
(``sink_bits`` 8: ``QuantizerSettings.sink_token_bytes``), counted as payload and scales.

Key correction (``quantizer.key_correction_rank = r > 0``): a key run of a corrected slot
also stores its correction code, ``r`` values per token quantized like channel-axis keys
(``key_correction_bits``, the keys' token groups, fp16 scale and zero per group and
component): counted as ``correction``.

Sliding-window layers (``geometry.layer_types[i] == "sliding"`` with ``geometry.sliding_window
= W``): the model attends to the newest ``W - 1`` past tokens only, so after ``T`` tokens such a
layer frees every whole aligned group of ``G`` positions that ends before ``T - (W - 1)``
(:func:`sliding_kept_start`), committed or still in the residual, and stores and counts only
what is left: its bytes and its values (the bpv denominator) are those of the kept tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from ..kernels.formats import Format
from ._checks import STREAMED, split_codes
from ._fields import SINK_AXIS


def committed_length(total: int, residual_length: int, group_size: int, grid_origin: int = 0) -> int:
    """Number of oldest tokens stored quantized once ``total`` tokens were written.

    Groups are aligned to ``grid_origin + k * group_size``: 0, or in a left-padded batch its longest
    padding (``KVPlanCache.align_to_padding``), so that the most-padded row commits exactly what it
    commits alone; the positions before the origin commit with the first group.
    """
    n = total - grid_origin
    if n < residual_length + group_size:
        return 0
    return grid_origin + group_size * ((n - residual_length) // group_size)


def sliding_kept_start(total: int, window: int | None, group_size: int, grid_origin: int = 0) -> int:
    """First position a sliding-window layer still stores once ``total`` tokens were written.

    The model's attention needs the newest ``window - 1`` past tokens (what transformers'
    ``DynamicSlidingWindowLayer`` keeps); the cache frees whole groups of ``group_size`` tokens
    (aligned to ``grid_origin``, see :func:`committed_length`) that lie entirely before them,
    committed or not, and the positions before the origin with the first of them.
    ``window=None`` (a full layer): 0.
    """
    n = total - grid_origin - (window - 1) if window is not None else 0
    if n < group_size:
        return 0
    return grid_origin + group_size * (n // group_size)


# per heavy-hitter copy and KV head, besides its K and V codes: its position (int32) and the
# attention score it was chosen by (fp32), shared by K and V
HEAVY_META_BYTES = 8


def heavy_tokens(committed: int, heavy_length: int, sink_length: int, sliding: bool = False) -> int:
    """Committed tokens each KV head keeps a heavy-hitter copy of (``quantizer.heavy_length``): up
    to ``heavy_length`` of its committed tokens that are not sink positions; none in a
    sliding-window layer (the tokens it frees would take their copies with them)."""
    if sliding:
        return 0
    return max(0, min(heavy_length, committed - min(sink_length, committed)))


def recent_tokens(committed: int, recent_length: int, sink_length: int, kept_start: int = 0) -> int:
    """Committed tokens that also keep a residual-precision copy (``quantizer.recent_length``): the
    newest ``recent_length`` of ``[max(sink, kept_start), committed)``; sink positions are full
    precision already and a sliding layer's freed positions are gone."""
    lo = max(min(sink_length, committed), kept_start)
    return max(0, min(recent_length, committed - lo))


def stream_tokens(committed: int, stream_window: int, recent_length: int, sink_length: int) -> int:
    """Committed tokens a streamed KV head (bits 0) keeps a copy of besides the recent copies every
    head keeps: its window is the newest ``stream_window`` committed non-sink tokens, and the newest
    :func:`recent_tokens` of them are held as recent copies already (a sliding-window layer streams only
    where they lie in its window: :func:`stream_fits_window`)."""
    lo = min(sink_length, committed)
    return max(0, min(stream_window, committed - lo) - recent_tokens(committed, recent_length, sink_length))


def stream_fits_window(q, window: int | None) -> bool:
    """Whether a layer of sliding ``window`` (``None``: a full layer) can stream KV heads under quantizer
    settings ``q``: a streamed head's copies (``stream_window`` tokens before the ``recent_length``
    recent copies) must lie in the positions the layer still shows its next queries, the newest
    ``window - 1``, with up to ``residual_length + group_size - 1`` tokens not committed yet after them."""
    return window is None or q.residual_length + q.group_size + q.recent_length + q.stream_window <= window


def _clip_runs(runs, start: int):
    """Stored runs ``(label, start, length, is_sink)`` restricted to positions ``>= start``."""
    out = []
    for lab, s, length, sink in runs:
        if s + length > start:
            cut = max(start - s, 0)
            out.append((lab, s + cut, length - cut, sink))
    return out


def label_runs(labels: Sequence, start: int = 0, end: int | None = None) -> list[tuple[object, int, int]]:
    """Maximal runs ``(label, start, length)`` of equal labels in ``labels[start:end]``."""
    end = len(labels) if end is None else end
    runs: list[tuple[object, int, int]] = []
    i = start
    while i < end:
        j = i
        while j < end and labels[j] == labels[i]:
            j += 1
        runs.append((labels[i], i, j - i))
        i = j
    return runs


def layout_labels(context_len: int, modality_mix) -> list[str]:
    """Token labels for a reference layout: contiguous runs in the mix's order.

    ``modality_mix`` is a mapping / sequence of ``(name, fraction)``; every run but the
    last gets ``floor(fraction * context_len)`` tokens, the last the remainder.
    Alternatively pass an explicit list of labels of length ``context_len``.
    """
    if isinstance(modality_mix, Mapping):
        modality_mix = list(modality_mix.items())
    modality_mix = list(modality_mix)
    if modality_mix and isinstance(modality_mix[0], str):  # explicit per-token labels
        if len(modality_mix) != context_len:
            raise ValueError(f"{len(modality_mix)} labels given for context_len {context_len}")
        return modality_mix
    labels: list[str] = []
    for lab, _, n in layout_runs(context_len, modality_mix):
        labels.extend([lab] * n)
    return labels


def layout_runs(context_len: int, modality_mix) -> list[tuple[object, int, int]]:
    """``label_runs(layout_labels(context_len, modality_mix))`` for a mix of fractions, without
    building one label per token (a plan's reference may be millions of tokens)."""
    pairs = list(modality_mix.items()) if isinstance(modality_mix, Mapping) else list(modality_mix)
    runs: list[tuple[object, int, int]] = []
    pos = 0
    for i, (name, frac) in enumerate(pairs):
        n = context_len - pos if i == len(pairs) - 1 else int(frac * context_len)
        if n <= 0:
            continue
        if runs and runs[-1][0] == name:
            runs[-1] = (name, runs[-1][1], runs[-1][2] + n)
        else:
            runs.append((name, pos, n))
        pos += n
    return runs


def stored_runs(labels: Sequence, committed_before: int, n: int,
                sink_length: int) -> list[tuple[object, int, int, bool]]:
    """How the runtime stores tokens ``[committed_before, committed_before + n)`` when it commits them.

    ``labels[i]`` is the label of absolute position ``committed_before + i``. Returns runs
    ``(label, absolute start, length, is_sink)``: maximal runs of one label, split at the
    sink boundary ``sink_length`` (positions before it are kept at full precision).
    """
    return _split_at_sink(label_runs(labels, 0, n), committed_before, sink_length)


def _split_at_sink(runs, committed_before: int, sink_length: int) -> list[tuple[object, int, int, bool]]:
    out = []
    for lab, off, length in runs:
        start = committed_before + off
        cut = min(max(sink_length - start, 0), length)
        if cut:
            out.append((lab, start, cut, True))
        if length > cut:
            out.append((lab, start + cut, length - cut, False))
    return out


@dataclass(frozen=True)
class BpvBreakdown:
    """Bits per cached value, split by what the bytes hold.

    ``total`` is computed from the total byte count (``8 * bytes / values``), so it equals
    the runtime's measured ``cache.bpv()`` exactly, not just up to float rounding.
    """

    total: float
    payload: float  # packed codes and 16-bit slots
    scales_zeros: float
    residual: float  # newest tokens not committed yet (full precision, or quantizer.residual_bits), and
    #                  the copies of the newest committed ones (quantizer.recent_length), of the
    #                  heavy hitters (quantizer.heavy_length, with their positions and scores) and of
    #                  the streamed heads' windows (quantizer.stream_window)
    correction: float = 0.0  # key correction codes with their scales and zero-points

    def as_dict(self) -> dict[str, float]:
        return {"total": self.total, "payload": self.payload, "scales_zeros": self.scales_zeros,
                "residual": self.residual, "correction": self.correction}


def run_bytes(bits: int, axis: str, group_size: int, head_dim: int, start: int, length: int,
              fp_bytes: int, fmt: Format | None = None) -> tuple[int, int]:
    """``(payload, scales_zeros)`` bytes one KV head stores for a committed run of tokens in ``fmt``
    (default: the v1 format at ``bits``); :meth:`kvplan.kernels.formats.Format.run_bytes`."""
    return (fmt or Format(bits)).run_bytes(axis, group_size, head_dim, start, length, fp_bytes)


def correction_bytes(q, start: int, length: int) -> int:
    """Bytes of the key correction code one corrected KV head stores for a committed run."""
    payload, scales = run_bytes(q.key_correction_bits, "channel", q.group_size, q.key_correction_rank, start,
                                length, 2)
    return payload + scales


def plan_bytes(plan, geometry, labels: Sequence[str], batch_size: int = 1, fp_bytes: int = 2) -> dict[str, int]:
    """Bytes the runtime stores for ``plan`` after writing tokens labelled ``labels``: a dict
    ``payload``, ``scales_zeros``, ``correction``, ``residual``."""
    q = plan.quantizer
    C = committed_length(len(labels), q.residual_length, q.group_size)
    return _runs_bytes(plan, geometry, len(labels), label_runs(labels, 0, C), batch_size, fp_bytes)


def _runs_bytes(plan, geometry, T: int, committed: list, batch_size: int, fp_bytes: int) -> dict[str, int]:
    """:func:`plan_bytes` of ``T`` tokens whose committed ones form the label runs ``committed``."""
    q = plan.quantizer
    table, corrected = split_codes(plan.code_table())
    C = sum(length for _, _, length in committed)
    unknown = sorted({lab for lab, _, _ in committed} - set(plan.modalities))
    if unknown:
        raise ValueError(f"labels {unknown} are not modalities of the plan {list(plan.modalities)}")
    payload = scales = correction = residual_tokens = heavy_copies = stream_copies = 0
    all_runs = _split_at_sink(committed, 0, q.sink_length)
    run_cost: dict[tuple, tuple[int, int]] = {}  # (kind, bits, start, length) -> bytes: slots share formats
    for layer in range(geometry.num_layers):
        # a sliding-window layer stores only from its kept start on (see sliding_kept_start)
        kept = sliding_kept_start(T, geometry.window(layer), q.group_size)
        runs = _clip_runs(all_runs, kept) if kept else all_runs
        residual_tokens += T - max(C, kept) + recent_tokens(C, q.recent_length, q.sink_length, kept)
        heavy_copies += heavy_tokens(C, q.heavy_length, q.sink_length, geometry.window(layer) is not None)
        n_streamed = int((table[layer, :, 0, 0] == STREAMED).sum())  # (a streamed head's slots all say 0)
        if n_streamed:
            stream_copies += n_streamed * stream_tokens(C, q.stream_window, q.recent_length, q.sink_length)
        for head in range(geometry.num_kv_heads):
            for k, kind in enumerate(("k", "v")):
                for lab, start, length, sink in runs:
                    bits = None if sink else int(table[layer, head, k, plan.modalities.index(lab)])  # None: the sink
                    if bits == STREAMED:  # no codes; its window copies are counted below
                        continue
                    key = (kind, bits, start, length)
                    if key not in run_cost:
                        fmt, axis = (q.sink_format, SINK_AXIS) if sink else (q.format(kind, bits), q.axis(kind))
                        run_cost[key] = fmt.run_bytes(axis, q.group_size, geometry.head_dim, start, length, fp_bytes)
                    p, s = run_cost[key]
                    payload += p
                    scales += s
                    if not sink and corrected[layer, head, k, plan.modalities.index(lab)]:
                        correction += correction_bytes(q, start, length)
    token_bytes = q.residual_token_bytes(geometry.head_dim, fp_bytes)
    residual = (((residual_tokens + heavy_copies) * token_bytes * 2 + heavy_copies * HEAVY_META_BYTES)
                * geometry.num_kv_heads + stream_copies * token_bytes * 2)
    return {"payload": payload * batch_size, "scales_zeros": scales * batch_size,
            "correction": correction * batch_size, "residual": residual * batch_size}


def plan_bpv(plan, geometry, context_len: int, modality_mix, full_precision_bits: int = 16) -> BpvBreakdown:
    """Honest bits per value of ``plan`` at ``context_len`` tokens laid out as ``modality_mix``
    (a mix of fractions, computed from its runs, or explicit per-token labels)."""
    pairs = list(modality_mix.items()) if isinstance(modality_mix, Mapping) else list(modality_mix)
    if pairs and isinstance(pairs[0], str):
        runs = label_runs(layout_labels(context_len, pairs))
    else:
        runs = layout_runs(context_len, pairs)
    T = sum(length for _, _, length in runs)
    q = plan.quantizer
    C = committed_length(T, q.residual_length, q.group_size)
    committed = [(lab, start, min(length, C - start)) for lab, start, length in runs if start < C]
    parts = _runs_bytes(plan, geometry, T, committed, 1, full_precision_bits // 8)
    n_values = geometry.num_kv_heads * 2 * geometry.head_dim * stored_tokens(geometry, context_len, q.group_size)
    if n_values == 0:  # every layer's window has freed every token (a window of 1): nothing stored, as the cache says
        return BpvBreakdown(0.0, 0.0, 0.0, 0.0)
    return BpvBreakdown(8 * sum(parts.values()) / n_values,
                        *(8 * parts[k] / n_values for k in ("payload", "scales_zeros", "residual", "correction")))


def stored_tokens(geometry, total: int, group_size: int) -> int:
    """Tokens the runtime holds summed over layers after ``total`` tokens (per KV head and kind):
    ``total`` per full layer, ``total - sliding_kept_start(...)`` per sliding-window layer. The
    values a sliding layer has freed are neither stored nor counted in its bits per value."""
    return sum(total - sliding_kept_start(total, geometry.window(layer), group_size)
               for layer in range(geometry.num_layers))
