"""Features of a plan for the surrogate: per-slot bits and aggregates.

Bits enter as ``log2(bits)`` (2 -> 1, 16 -> 4), so "one more bit" is a similar step at
every width; a key slot with the key correction adds ``CORRECTION_FEATURE`` (see
:func:`bits_feature`). Columns:

- ``slot:L03.H1.k.doc``   one per slot of the table;
- ``mean:k`` / ``mean:v``, ``mean:<modality>``, ``mean:k.<modality>``, ``layer:L03``,
  ``layer:L03.k``;
- ``q.group_size`` (log2), ``q.residual_length``, ``q.key_axis_channel``, ``q.sink_length``, ``q.recent_length``
  (only where the space offers recent copies);
- ``bpv`` (honest, at the reference) and, when a sensitivity prior is given,
  ``prior:log_damage`` (log of the profile-predicted damage).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..plans import KINDS, split_codes


# feature offset of a corrected key slot: 2 bits + correction sits between 2 (1.0) and 3 (1.58) bits
CORRECTION_FEATURE = 0.3


def bits_feature(tables) -> np.ndarray:
    """``log2(bits)`` of format-code tables (``Plan.code_table``), plus ``CORRECTION_FEATURE``
    on corrected key slots; float, same shape. A streamed head's slots (bits 0, no codes) read 0,
    below every stored width."""
    bits, corrected = split_codes(np.asarray(tables, dtype=np.int64))
    return np.log2(np.maximum(bits, 1).astype(np.float64)) + CORRECTION_FEATURE * corrected


def slot_names(shape, modalities) -> list[str]:
    L, H, _, M = shape
    return [f"L{l:02d}.H{h}.{KINDS[k]}.{modalities[m]}"
            for l in range(L) for h in range(H) for k in range(2) for m in range(M)]


class PlanFeatures:
    """Turns ``(tables, quantizer fields, bpv, prior)`` into a feature matrix with named columns."""

    def __init__(self, shape, modalities: Sequence[str], with_prior: bool = False, with_recent: bool = False):
        self.shape = tuple(shape)
        self.modalities = tuple(modalities)
        self.with_prior = with_prior
        # q.recent_length only where the space offers copies (a constant column would still change
        # which features each tree samples)
        self.with_recent = with_recent
        L, H, _, M = self.shape
        names = ["slot:" + n for n in slot_names(self.shape, self.modalities)]
        names += ["mean:k", "mean:v"]
        if M > 1:
            names += [f"mean:{m}" for m in self.modalities]
            names += [f"mean:{k}.{m}" for k in KINDS for m in self.modalities]
        names += [f"layer:L{l:02d}" for l in range(L)]
        names += [f"layer:L{l:02d}.{k}" for l in range(L) for k in KINDS]
        names += ["q.group_size", "q.residual_length", "q.key_axis_channel", "q.sink_length"]
        names += (["q.recent_length"] if with_recent else []) + ["bpv"]
        if with_prior:
            names.append("prior:log_damage")
        self.names = names

    def transform(self, tables: np.ndarray, group_sizes, residual_lengths, key_axes, bpv,
                  prior_damage=None, sink_lengths=None, recent_lengths=None) -> np.ndarray:
        """``tables``: int ``[N, L, H, 2, M]``; the rest length-N sequences (``sink_lengths`` and
        ``recent_lengths`` default to 0). Returns float ``[N, F]``."""
        t = bits_feature(tables)
        N = t.shape[0]
        L, H, _, M = self.shape
        cols = [t.reshape(N, -1), t[:, :, :, 0].reshape(N, -1).mean(1, keepdims=True),
                t[:, :, :, 1].reshape(N, -1).mean(1, keepdims=True)]
        if M > 1:
            cols.append(t.mean(axis=(1, 2, 3)))
            cols.append(t.mean(axis=(1, 2)).reshape(N, 2 * M))
        cols.append(t.mean(axis=(2, 3, 4)))
        cols.append(t.mean(axis=(2, 4)).reshape(N, L * 2))
        cols.append(np.log2(np.asarray(group_sizes, dtype=np.float64))[:, None])
        cols.append(np.asarray(residual_lengths, dtype=np.float64)[:, None])
        cols.append((np.asarray(key_axes) == "channel").astype(np.float64)[:, None])
        cols.append(np.asarray(sink_lengths if sink_lengths is not None else np.zeros(N), dtype=np.float64)[:, None])
        if self.with_recent:
            cols.append(np.asarray(recent_lengths if recent_lengths is not None else np.zeros(N),
                                   dtype=np.float64)[:, None])
        cols.append(np.asarray(bpv, dtype=np.float64)[:, None])
        if self.with_prior:
            pd = np.asarray(prior_damage if prior_damage is not None else np.ones(N), dtype=np.float64)
            cols.append(np.log(np.maximum(pd, 1e-12))[:, None])
        X = np.concatenate(cols, axis=1)
        assert X.shape[1] == len(self.names)
        return X
