"""The quantized KV cache: a transformers ``Cache`` whose storage follows a plan.

Per layer and per kind (K, V) the cache holds committed :class:`Segment` s (packed,
never re-quantized) and a :class:`Residual` of the newest tokens (full precision, or per-token
codes with ``quantizer.residual_bits``). After each
``update`` the oldest tokens beyond the residual are committed block-wise following
``plans.accounting.committed_length``; each committed token is stored at the bits of
its modality, fixed at the time it entered the cache.

Tokens committed during an ``update`` are returned to that forward pass at full
precision (their first use, e.g. prefill attention); every later read sees them
dequantized.

Recent copies (``quantizer.recent_length`` ``W``): when tokens commit, the newest ``W`` committed
ones keep their residual form (moved, not coded again) in ``KVPlanLayer.recent``, and every read
uses it instead of their slot codes until newer tokens commit (``plans.accounting.recent_tokens``).

Heavy-hitter copies (``quantizer.heavy_length``, full-attention layers): copies of each KV head's
most-attended committed tokens, chosen by a prompt's last queries (:mod:`kvplan.runtime.heavy`);
reads of a quantized slot use them instead of the slot codes.

Streamed KV heads (slots at bits 0, ``quantizer.stream_window`` ``W``, DuoAttention's streaming
heads): their committed tokens store no codes; they keep copies of their newest ``W`` committed
non-sink tokens in residual form (``KVPlanLayer.stream_copies``, besides the recent copies every head
keeps; ``plans.accounting.stream_tokens``), and every attention route masks their other committed
non-sink positions off (:meth:`KVPlanLayer.stream_hidden`). A sliding-window layer streams heads
where its window holds those copies (``plans.accounting.stream_fits_window``); once it frees its sink,
a streamed head attends to its copies and the residual only.

Sliding-window layers (Gemma 3, Mistral, ...) free the whole token groups that fell out of
their window (see :class:`KVPlanLayer`), so their bytes follow what the model can still attend
to; the attention mask gets the kept range from ``get_mask_sizes``.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import replace
from typing import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..errors import CacheError, PlanError
from ..models.geometry import Geometry, text_config
from ..kernels import FULL_PRECISION_BITS
from ..kernels.feedback import feedback_factors
from ..kernels.formats import ScaleRangeError
from ..kernels.rotation import AngleTable, Rotation, hadamard_matrix
from ..plans import KINDS, STREAMED, Plan, committed_length, split_codes, stored_runs
from ..plans._fields import SINK_AXIS
from ..plans.accounting import recent_tokens, sliding_kept_start, stream_tokens
from .fused import ATTENTION_NAME, MAX_FUSED_QUERY, mark_observed, mark_pending, mark_streamed
from .heavy import HeavyCopies, window_mass
from .storage import PackedBlock, Residual, Segment

TEXT = "text"


def plan_rotations(plan: Plan, device, layer: int = 0, tables: dict | None = None) -> dict[str, Rotation | None]:
    """The write/read rotation of quantized Keys and Values of ``layer`` under ``plan`` (``None``:
    none); pre-RoPE keys use that layer's RoPE frequencies (hybrid models have several bases).
    ``tables``: the RoPE angle tables already made for other layers (shared, filled here)."""
    q = plan.quantizer
    return layer_rotations(plan.geometry.head_dim, q.rotation, plan.layer_inv_freq(layer) if q.key_pre_rope else None,
                           device, tables)


def layer_rotations(head_dim: int, rotation: str, inv_freq, device, tables: dict | None = None
                    ) -> dict[str, Rotation | None]:
    """:func:`plan_rotations` from the settings: ``rotation`` ("hadamard" / "none") and the
    layer's RoPE inverse frequencies ``inv_freq`` when keys are stored pre-RoPE (else None).
    ``tables``: :class:`AngleTable` s by frequencies, shared by the layers of one cache."""
    H = hadamard_matrix(head_dim, device) if rotation == "hadamard" else None
    table = None
    if inv_freq is None:
        inv = None
    else:
        inv = torch.tensor(inv_freq, dtype=torch.float32, device=device)
        if tables is not None:  # keyed by the frequencies as given: no copy back from the device
            table = tables.setdefault((str(device), tuple(float(f) for f in inv_freq)), AngleTable(inv))
    return {"k": None if H is None and inv is None else Rotation(H, inv, table),
            "v": None if H is None else Rotation(H)}


def _layer_feedback(metric, layer: int, device: torch.device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per kind, the error-feedback encoder's ``(U [H_kv, D, D], order [H_kv, D])`` of one layer of a
    plan's ``feedback_metric``: factorized once per metric, layer and device and kept on the metric
    (a plan constant; every cache of the plan, e.g. one per scored sample, reads the same read-only
    tensors)."""
    memo = metric.__dict__.setdefault("_factors", {})
    key = (layer, str(device))
    if key not in memo:
        memo[key] = {kind: feedback_factors(torch.from_numpy(metric.array[layer, i].astype("float32")).to(device))
                     for i, kind in enumerate(KINDS)}
    return memo[key]


class KVPlanLayer(CacheLayerMixin):
    """One decoder layer of a :class:`KVPlanCache`.

    A sliding-window layer (``window`` set) stores positions ``[dropped, T)`` only: after each
    commit it frees the whole aligned groups that lie before the newest ``window - 1`` tokens
    (``plans.accounting.sliding_kept_start``), committed or not; reads, the mask sizes and the
    byte and value counts cover what it keeps. Full layers have ``dropped == 0``.
    """

    is_compileable = False

    def __init__(self, owner: "KVPlanCache", layer_idx: int):
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx
        plan = owner.plan
        self.window = plan.geometry.window(layer_idx)  # None: keeps its whole history
        self.is_sliding = plan.geometry.layer_types[layer_idx] == "sliding"
        self.dropped = 0  # positions before it are freed (sliding-window layers)
        table = owner.code_table[layer_idx]  # [H_kv, 2, M] format codes (bits, + CORRECTED if corrected)
        # kind -> modality -> [(code, heads)] head groups sharing a quantizer setting
        self.head_groups: dict[str, dict[str, list[tuple[int, tuple[int, ...]]]]] = {}
        for k, kind in enumerate(KINDS):
            self.head_groups[kind] = {}
            for m, mod in enumerate(plan.modalities):
                groups: dict[int, list[int]] = {}
                for h in range(table.shape[0]):
                    groups.setdefault(int(table[h, k, m]), []).append(h)
                self.head_groups[kind][mod] = sorted((b, tuple(hs)) for b, hs in groups.items())
        self.segments: dict[str, list[Segment]] = {"k": [], "v": []}
        # kind -> packed_segments(kind), kept until the segments or the copies change (_stored_changed)
        self._packed: dict[str, list[list[PackedBlock]]] = {}
        self.residual: dict[str, Residual | None] = {"k": None, "v": None}  # [B, H_kv, T_res, D] each
        # copies of the newest committed tokens [committed - n_recent, committed) (quantizer.recent_length)
        self.recent: dict[str, Residual | None] = {"k": None, "v": None}
        # copies of the most-attended committed tokens (quantizer.heavy_length; full layers only)
        self.heavy: HeavyCopies | None = None
        # streamed KV heads (bits 0): their copies of the committed tokens before the recent copies, up to
        # quantizer.stream_window in all ([B, n_streamed, n, D]; None: no streamed head)
        self.streamed: tuple[int, ...] = tuple(h for h in range(table.shape[0]) if table[h, 0, 0] == STREAMED)
        self.stream_copies: dict[str, Residual] | None = None
        # positions of the keys the last dequantize-route update returned that the streamed heads must not
        # attend to (read by kvplan's attention function, fused.mark_streamed)
        self.read_hidden: tuple[int, int] | None = None
        self.residual_labels: list[str] = []
        self.committed = 0
        self.key_basis: torch.Tensor | None = None  # [H_kv, D, r] fp32 when the plan corrects keys
        self.rotation: dict[str, Rotation | None] = {"k": None, "v": None}  # per kind, quantized blocks only
        # per kind: the error-feedback encoder's (U [H_kv, D, D], order [H_kv, D]) (empty: plan has no metric)
        self.feedback: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._nonfinite: torch.Tensor | None = None  # CUDA: bool device flag, non-finite states since the last commit

    # ------------------------------------------------------------------ Cache layer API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        n_kv, head_dim = key_states.shape[1], key_states.shape[-1]
        g = self.owner.geometry
        if n_kv != g.num_kv_heads or head_dim != g.head_dim:
            raise CacheError(
                f"layer {self.layer_idx}: cache receives [B, {n_kv}, T, {head_dim}] keys but the plan was made for "
                f"{g.num_kv_heads} KV heads of head_dim {g.head_dim}"
            )
        q = self.owner.plan.quantizer

        def empty(x: torch.Tensor, heads: int) -> torch.Tensor:  # [B, heads, 0, D], owning no storage: a
            # zero-length slice of x would be a view keeping the whole prompt's states alive, uncounted
            return x.new_empty((x.shape[0], heads, 0, x.shape[-1]), dtype=self.dtype)

        self.residual = {kind: Residual(q.residual_bits, q.group_size, empty(x, n_kv))
                         for kind, x in (("k", key_states), ("v", value_states))}
        self.recent = {kind: Residual(q.residual_bits, q.group_size, empty(x, n_kv))
                       for kind, x in (("k", key_states), ("v", value_states))}
        if q.heavy_length and self.window is None:
            self.heavy = HeavyCopies(q.heavy_length, q.residual_bits, q.group_size)
        if self.streamed:
            idx = list(self.streamed)
            self.stream_copies = {kind: Residual(q.residual_bits, q.group_size, empty(x, len(idx)))
                                  for kind, x in (("k", key_states), ("v", value_states))}
        basis = self.owner.plan.key_basis
        # key correction basis of this layer: fp32 [H_kv, D, r] on the cache's device
        self.key_basis = (None if basis is None else
                          torch.from_numpy(basis.array[self.layer_idx].astype("float32")).to(self.device))
        self.rotation = plan_rotations(self.owner.plan, self.device, self.layer_idx, self.owner.angle_tables)
        padding = self.owner.row_padding
        if padding is not None:  # a left-padded batch: each row keyed on its RoPE positions
            B = key_states.shape[0]
            if B % len(padding):
                raise CacheError(f"layer {self.layer_idx}: the prompt's attention mask has {len(padding)} rows, "
                                 f"its keys {B}")
            # generate repeats each prompt row for beams / num_return_sequences after the mask was read
            padding = [p for p in padding for _ in range(B // len(padding))]
            for rotation in self.rotation.values():
                if rotation is not None:
                    rotation.set_row_padding(padding)
        metric = self.owner.plan.feedback_metric
        self.feedback = {} if metric is None else _layer_feedback(metric, self.layer_idx, self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``[B, H_kv, T_new, D]`` states; return all keys and values ``[B, H_kv, T, D]``. The cache
        stores values, not autograd history: what it returns carries no gradient (a forward with gradients
        on runs as under ``torch.no_grad`` here, and keeps no graph alive)."""
        key_states, value_states = key_states.detach(), value_states.detach()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t_new = key_states.shape[-2]
        self.owner.check_attention()
        if self.heavy is not None:
            self.heavy.resolve()  # tokens committed since the last scoring attention call: unscored
        # NaN / Inf check: one reduction of both kinds (any NaN/Inf makes the sum non-finite; only
        # then, or on an overflowing sum, the element-wise check that locates it runs). On CPU it
        # is read at once. On CUDA reading it would synchronise the host every layer and step, so
        # the device-side result is or-ed into a flag that _commit reads once per commit, before
        # any of these tokens is quantized (until then they are only in the residual)
        nonfinite = ~torch.isfinite(key_states.sum() + value_states.sum())
        if key_states.is_cuda:
            self._nonfinite = nonfinite if self._nonfinite is None else self._nonfinite | nonfinite
        elif bool(nonfinite):
            self._raise_nonfinite(key_states, value_states, "new token")
        fused = self.owner.attention_kernel is not None and t_new <= MAX_FUSED_QUERY
        # decided on the state get_mask_sizes saw (the pending commit below frees nothing either)
        decode_step = self._decode_step(t_new)
        packed = fused and decode_step
        if fused:
            self._commit(free=False)  # a commit left pending by the previous step's attention call, if any
        start = self.get_seq_length()
        self.owner.check_prompt_labelled(start, t_new)
        self.residual_labels.extend(self.owner.labels_for(start, t_new))
        self.residual["k"].append(key_states.to(self.dtype))
        self.residual["v"].append(value_states.to(self.dtype))
        if packed:
            # the fused attention reads the packed segments itself (up to the recent copies,
            # packed_segments) and commits afterwards
            keys, values = self._dense_tail("k"), self._dense_tail("v")
            mark_pending(keys, self)
            return keys, values
        first = self._visible_start(start)  # what get_mask_sizes told the mask (``start`` tokens before)
        keys = self._read("k", first)
        values = self._read("v", first)
        hidden = self.stream_hidden()
        if hidden is not None and hidden[1] > first:  # kvplan's attention function hides them (from ``first``)
            self.read_hidden = (max(hidden[0], first) - first, hidden[1] - first)
            mark_streamed(keys, self)
        self._commit()
        if self.heavy is not None and self.heavy.pending:
            if decode_step:  # unscored, as the fused route leaves them
                self.heavy.resolve()
            else:  # a prompt: its attention call scores the committed tokens (observe_prompt)
                mark_observed(keys, self)
        return keys, values

    def observe_prompt(self, query: torch.Tensor, keys: torch.Tensor, scaling: float,
                       attention_mask: torch.Tensor | None = None) -> None:
        """Score the tokens this forward committed by the attention its last queries ``query [B, Hq,
        Tq, D]`` give ``keys [B, H_kv, T_k, D]`` (what ``update`` returned: positions from the
        layer's first kept one) and keep the heavy-hitter copies (:mod:`kvplan.runtime.heavy`).
        Called by kvplan's attention function; the search's harness calls it with the queries its
        full-precision prefill recorded. A no-op without waiting tokens."""
        if self.heavy is None or not self.heavy.pending:
            return
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        self.heavy.resolve(window_mass(query, keys, scaling, attention_mask), first=self._visible_start(
            self.get_seq_length()))

    def stream_hidden(self) -> tuple[int, int] | None:
        """Positions ``[a, b)`` the streamed heads' queries must not attend to now: committed, not a
        sink position, older than their copies and the recent copies (nothing stored there), not freed
        (a sliding-window layer). ``None``: no streamed head, or nothing hidden yet."""
        if self.stream_copies is None:
            return None
        a = max(min(self.owner.sink_length, self.committed), self.dropped)
        b = self.committed - self.recent["k"].length - self.stream_copies["k"].length
        return (a, b) if b > a else None

    def stream_reads(self, kind: str, dtype: torch.dtype) -> torch.Tensor:
        """The streamed heads' copies as read, scattered into every KV head: ``[B, H_kv, n, D]`` (zeros in
        the other heads, which never attend to them)."""
        store = self.stream_copies[kind]
        B, _, n, D = store.shape
        out = torch.zeros(B, self.owner.geometry.num_kv_heads, n, D, dtype=dtype, device=store.device)
        out[:, list(self.streamed)] = store.read().to(dtype)
        return out

    def heavy_reads(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(positions [B, H_kv, m] int64, used [B, H_kv, m] bool)`` of the heavy-hitter copies and
        which of them replace the token's reads: those whose K and V slots at that token are both
        quantized (a 16-bit slot reads its exact token; both kinds are swapped together, so every
        attention route reads the same). ``None`` without copies."""
        h = self.heavy
        if h is None or not h.length:
            return None
        pos = h.positions.long()
        if h.slots_quantized is None:  # [H_kv, M]: both kinds' slots below 16 bits
            table = torch.from_numpy(self.owner.code_table[self.layer_idx] != FULL_PRECISION_BITS)  # [H_kv, 2, M]
            h.slots_quantized = table.all(dim=1)
        both = h.slots_quantized.to(pos.device)
        mods = self.owner.plan.modalities
        if len(mods) == 1:
            return pos, both[:, 0][None, :, None].expand_as(pos)
        segs = self.segments["k"]
        starts = torch.tensor([s.start for s in segs], device=pos.device)
        seg_mod = torch.tensor([mods.index(s.modality) for s in segs], device=pos.device)
        mod_at = seg_mod[torch.searchsorted(starts, pos, right=True) - 1]  # [B, H_kv, m]
        heads = torch.arange(pos.shape[1], device=pos.device)[None, :, None].expand_as(pos)
        return pos, both[heads, mod_at]

    def _raise_nonfinite(self, keys: torch.Tensor, values: torch.Tensor, where: str) -> None:
        """Raise CacheError naming the first non-finite value of ``keys`` / ``values [B, H_kv, T, D]``
        (``where`` names what T indexes); return if all are finite (the sum overflowed)."""
        for kind, x in (("k", keys), ("v", values)):
            if not bool(torch.isfinite(x).all()):
                bad = (~torch.isfinite(x)).nonzero()[0].tolist()
                raise CacheError(
                    f"layer {self.layer_idx}: non-finite {'key' if kind == 'k' else 'value'} states arriving in the "
                    f"cache (first at [batch {bad[0]}, kv_head {bad[1]}, {where} {bad[2]}, dim {bad[3]}]); "
                    "refusing to store them"
                )

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the keys ``update`` hands to attention: the fused kernels read
        every kept position ``[dropped, T)``; the dequantize route gets what the model's own
        ``DynamicSlidingWindowLayer`` returns (the newest ``window - 1`` past positions), so an
        all-16-bit plan attends over bit-identical tensors. Plus the new tokens."""
        T = self.get_seq_length()
        packed = self.owner.attention_kernel is not None and self._decode_step(query_length)
        first = self.dropped if packed else self._visible_start(T)
        return T - first + query_length, first

    def _decode_step(self, t_new: int) -> bool:
        """Whether a forward of ``t_new`` tokens is a decode step, on every route: what the fused kernels
        attend for (at most ``MAX_FUSED_QUERY`` tokens once the layer has committed any); its commits
        are not scored for the heavy-hitter copies (a prompt's are)."""
        return t_new <= MAX_FUSED_QUERY and self.committed > 0

    def _visible_start(self, total: int) -> int:
        """First position the attention of the next tokens needs after ``total`` tokens (0 for a
        full layer; a sliding layer's newest ``window - 1``, never before what it keeps)."""
        if self.window is None:
            return self.dropped
        return max(self.dropped, total - (self.window - 1))

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return 0
        return self.committed + self.residual["k"].length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.segments = {"k": [], "v": []}
        self._stored_changed()
        self.residual = {"k": None, "v": None}
        self.recent = {"k": None, "v": None}
        self.heavy = None
        self.stream_copies = None
        self.residual_labels = []
        self.committed = 0
        self.dropped = 0
        self._nonfinite = None
        self.is_initialized = False

    def check_crop(self, n: int) -> None:
        """Refuse to remove the ``n`` newest tokens unless what is left is what the plan stores at that length
        (``plans.accounting``): tokens that are no longer in the residual, a residual left with fewer than the
        plan's ``residual_length`` unquantized tokens (a commit cannot be undone), or a sliding-window layer
        whose freed tokens attention would need again (as transformers' ``DynamicSlidingWindowLayer``
        refuses to crop once its window is full)."""
        if not n or not self.is_initialized:
            return
        if n > self.residual["k"].length:
            raise CacheError(
                f"layer {self.layer_idx}: cannot remove {n} tokens; only the {self.residual['k'].length} newest "
                "(the residual) can be removed, older ones are already quantized"
            )
        q, origin, total = self.owner.plan.quantizer, self.owner.grid_origin, self.get_seq_length()

        def breaks_layout(removed: int) -> tuple[bool, bool]:
            """(the plan would keep committed tokens unquantized, the window would need freed tokens)"""
            left = total - removed
            return (committed_length(left, q.residual_length, q.group_size, origin) < self.committed,
                    self.window is not None and sliding_kept_start(left, self.window, q.group_size, origin)
                    < self.dropped)

        broken = breaks_layout(n)
        if not any(broken):
            return
        most = next(m for m in range(n - 1, -1, -1) if not any(breaks_layout(m)))
        if broken[0]:
            why = (f"at {total - n} tokens the plan keeps its newest {q.residual_length} unquantized, and "
                   f"tokens up to position {self.committed - 1} are already quantized")
        else:
            why = (f"its sliding window of {self.window} at {total - n} tokens reaches back before position "
                   f"{self.dropped}, and the tokens before it are already freed")
        raise CacheError(f"layer {self.layer_idx}: cannot remove {n} tokens: {why}; at most {most} can be removed "
                         "now")

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        n = -tokens_to_remove
        if n == 0 or not self.is_initialized:
            return
        self.check_crop(n)
        for kind in KINDS:
            self.residual[kind].drop_newest(n)
        del self.residual_labels[-n:]

    def _map_batch(self, fn) -> None:
        if not self.is_initialized:
            return
        for kind in KINDS:
            self.residual[kind].map_tensors(fn)
            self.recent[kind].map_tensors(fn)
            for seg in self.segments[kind]:
                for block in seg.blocks:
                    block.map_tensors(fn)
        if self.heavy is not None:
            self.heavy.map_tensors(fn)
        if self.stream_copies is not None:
            for store in self.stream_copies.values():
                store.map_tensors(fn)
        for rotation in self.rotation.values():
            if rotation is not None:
                rotation.map_rows(fn)
        self._stored_changed()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices, ...])

    def offload(self):
        self._map_batch(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        if self.is_initialized and self.residual["k"].device != self.device:
            self._map_batch(lambda t: t.to(self.device, non_blocking=True))

    # ------------------------------------------------------------------ storage
    def _read(self, kind: str, first: int | None = None) -> torch.Tensor:
        """Dequantized committed tokens followed by the residual, from position ``first`` on
        (default: every kept position): ``[B, H_kv, T - first, D]``.

        Hot path of every step on the dequantize-then-attend route: one output tensor is
        allocated and every packed block is dequantized straight into its token range and
        heads (on the reference path), then the residual is copied into the tail. No
        dequantized copy outlives the call.
        """
        segs = self.segments[kind]
        res = self.residual[kind].read()
        base = self.dropped  # out[:, :, i] is position base + i
        first = base if first is None else first
        if not segs or first >= self.committed:  # residual only
            return res if first <= self.committed else res[:, :, first - self.committed :].contiguous()
        B, H, n_res, D = res.shape
        out = torch.empty(B, H, self.committed - base + n_res, D, dtype=self.dtype, device=res.device)
        for seg in segs:
            rows = out[:, :, seg.start - base : seg.start - base + seg.length]
            for block in seg.blocks:
                for h0, h1, run in block.head_runs():  # contiguous heads: views, no temporary
                    run.decode_into(rows[:, h0:h1])
        n_rec = self.recent[kind].length
        if n_rec:  # the newest committed tokens read from their copies
            out[:, :, self.committed - base - n_rec : self.committed - base].copy_(self.recent[kind].read())
        if self.stream_copies is not None and self.stream_copies[kind].length:  # the streamed heads' windows
            n_win = self.stream_copies[kind].length
            end = self.committed - base - n_rec
            out[:, list(self.streamed), end - n_win : end] = self.stream_copies[kind].read().to(out.dtype)
        heavy = self.heavy_reads()
        if heavy is not None:  # the heavy hitters of quantized slots read from their copies
            pos, used = heavy
            idx = (pos - base)[..., None].expand(*pos.shape, out.shape[-1])
            out.scatter_(2, idx, torch.where(used[..., None], self.heavy.read(kind, out.dtype), out.gather(2, idx)))
        out[:, :, self.committed - base :].copy_(res)
        return out if first == base else out[:, :, first - base :].contiguous()

    def _dense_tail(self, kind: str) -> torch.Tensor:
        """What the fused kernels get dense: the recent copies then the residual, ``[B, H_kv, n, D]``."""
        res = self.residual[kind].read()
        if not self.recent[kind].length:
            return res
        return torch.cat([self.recent[kind].read(), res], dim=-2)

    def packed_segments(self, kind: str) -> list[list[PackedBlock]]:
        """Each segment's blocks for the fused kernels: committed positions up to the recent copies
        (which :meth:`_dense_tail` hands over dense), in order. Built once per commit (every decode
        step between two commits reads the same list)."""
        out = self._packed.get(kind)
        if out is None:
            end = self.committed - self.recent[kind].length
            out = []
            for seg in self.segments[kind]:
                if seg.start >= end:
                    break
                n = min(seg.length, end - seg.start)
                out.append(seg.blocks if n == seg.length else [b.token_range(0, n) for b in seg.blocks])
            self._packed[kind] = out
        return out

    def _stored_changed(self) -> None:
        """Forget :meth:`packed_segments`' lists: segments, their tensors or the copies changed."""
        self._packed = {}

    def _commit(self, free: bool = True) -> None:
        """Quantize the tokens that are due (``plans.accounting.committed_length``) and append them;
        first (unless ``free`` is false) a sliding-window layer frees what left its window.

        Host synchronisations: none on CPU. On CUDA one per commit (every ``group_size`` tokens
        or so, not every step): a single read of two device flags, the non-finite check of the
        tokens that arrived since the last commit and the fp16-range check of the Triton
        quantize calls of this commit; it comes before anything is appended, so a failed check
        stores nothing. Appending copies only the new tokens (``PackedBlock.append``).

        Then the residual's fresh tokens are coded (``quantizer.residual_bits`` < 16,
        :meth:`Residual.seal`): their first forward is over.
        """
        if self.owner.commits_paused:
            return
        q = self.owner.plan.quantizer
        total = self.get_seq_length()
        origin = self.owner.grid_origin
        if self.window is not None and free:
            kept = sliding_kept_start(total, self.window, q.group_size, origin)
            if kept > self.dropped:
                self._free_before(kept)
        target = committed_length(total, q.residual_length, q.group_size, origin)
        if target > self.committed:
            self._commit_oldest(target)
        for kind in KINDS:
            self.residual[kind].seal()
            self.recent[kind].seal()
            if self.stream_copies is not None:
                self.stream_copies[kind].seal()

    def _trim_recent(self) -> None:
        """Keep the copies of the newest ``recent_length`` committed tokens only
        (``plans.accounting.recent_tokens``: never a sink position or a freed one)."""
        q = self.owner.plan.quantizer
        keep = recent_tokens(self.committed, q.recent_length, self.owner.sink_length, self.dropped)
        for kind in KINDS:
            self.recent[kind].drop_oldest(self.recent[kind].length - keep)
        self._stored_changed()  # called by every change of the segments (commit, free)

    @contextlib.contextmanager
    def _coding(self, kind: str, heads, start: int, length: int, x: torch.Tensor):
        """Name where a block ``x [B, len(heads), length, D]`` cannot be coded (a scale past its format's
        range): the layer, K/V, the positions and the KV head holding the largest magnitude."""
        try:
            yield
        except ScaleRangeError as e:
            largest = heads[int(x.abs().float().amax(dim=(0, 2, 3)).argmax())]
            raise CacheError(f"layer {self.layer_idx}, {'keys' if kind == 'k' else 'values'} of KV head {largest} "
                             f"at positions {start} .. {start + length - 1}: {e}") from None

    def _commit_oldest(self, target: int) -> None:
        """Quantize residual tokens ``[committed, target)`` into segments (see :meth:`_commit`)."""
        q = self.owner.plan.quantizer
        n = target - self.committed
        on_cuda = self.residual["k"].device.type == "cuda"
        if self._nonfinite is not None:
            if bool(self._nonfinite):  # host sync (CUDA, once per commit; see above)
                self._raise_nonfinite(self.residual["k"].read(), self.residual["v"].read(),
                                      f"cache position {self.committed} +")
            self._nonfinite = None
        range_flag = torch.zeros(1, dtype=torch.int32, device=self.residual["k"].device) if on_cuda else None
        runs = stored_runs(self.residual_labels, self.committed, n, self.owner.sink_length)
        all_heads = tuple(range(self.owner.geometry.num_kv_heads))
        new = {kind: [] for kind in KINDS}  # kind -> [(label, start, length, blocks)]
        for kind in KINDS:
            chunk = self.residual[kind].oldest(n)  # as read: coded residual tokens are encoded from their read
            for label, start, length, sink in runs:
                offset = start - self.committed
                x = chunk[:, :, offset : offset + length]
                if sink:  # attention-sink positions: every head as quantizer.sink_bits says
                    with self._coding(kind, all_heads, start, length, x):
                        blocks = [PackedBlock.encode(x, all_heads, q.sink_bits, SINK_AXIS, q.group_size, start,
                                                     rotation=self.rotation[kind], range_flag=range_flag,
                                                     fmt=q.sink_format)]
                    new[kind].append((label, start, length, blocks))
                    continue
                blocks = []
                for code, heads in self.head_groups[kind][label]:
                    xh = x if len(heads) == x.shape[1] else x[:, list(heads)]
                    bits, corrected = split_codes(code)
                    basis = self.key_basis[list(heads)] if corrected else None
                    fb = self.feedback.get(kind)
                    if fb is not None and len(heads) != fb[0].shape[0]:
                        fb = (fb[0][list(heads)], fb[1][list(heads)])
                    fmt = None if bits == STREAMED else q.format(kind, bits)
                    with self._coding(kind, heads, start, length, xh):
                        blocks.append(PackedBlock.encode(xh, heads, bits, q.axis(kind), q.group_size, start, basis,
                                                         q.key_correction_bits, self.rotation[kind], range_flag, fmt,
                                                         fb, grid_origin=self.owner.grid_origin))
                new[kind].append((label, start, length, blocks))
        if range_flag is not None and bool(range_flag.item()):  # host sync (CUDA, once per commit; see above)
            raise CacheError("KV values exceed the fp16 range of the stored scales/zero-points; cannot quantize "
                             f"layer {self.layer_idx}, tokens {self.committed} .. {target - 1}")
        first_candidate = max(self.committed, self.owner.sink_length)  # sink positions are stored apart
        if self.heavy is not None and first_candidate < target:
            self.heavy.add_candidates(first_candidate, {kind: self.residual[kind].parts(
                first_candidate - self.committed, n) for kind in KINDS})
        sink_end = self.owner.sink_length
        for kind in KINDS:
            for label, start, length, blocks in new[kind]:
                segs = self.segments[kind]
                # a sink segment never absorbs the slots after it, even where their layouts match (token-axis
                # values at the sink's bits): keys and values then list the same segments, as the fused
                # Triton kernel reads them, pair by pair
                if (segs and segs[-1].modality == label and segs[-1].start + segs[-1].length == start
                        and (segs[-1].start < sink_end) == (start < sink_end)
                        and [b.layout() for b in segs[-1].blocks] == [b.layout() for b in blocks]):
                    for old, blk in zip(segs[-1].blocks, blocks):
                        old.append(blk)
                    segs[-1].length += length
                else:
                    segs.append(Segment(label, start, length, blocks))
            if self.stream_copies is not None:
                self._push_stream_copies(kind, target)
            if q.recent_length:  # the newest committed tokens keep their residual form (moved)
                self.recent[kind].push(*self.residual[kind].parts(max(0, n - q.recent_length), n))
            # keep only the uncommitted tail (copied, so the committed tokens' bytes are freed; the
            # residual holds at most residual_length + group_size tokens: O(1) per step)
            self.residual[kind].drop_oldest(n)
        del self.residual_labels[:n]
        self.committed = target
        self._trim_recent()

    def _push_stream_copies(self, kind: str, target: int) -> None:
        """Before tokens ``[committed, target)`` commit: the streamed heads' copies take, in order, the
        recent copies that will be dropped and the newly committed non-sink tokens that will get no
        recent copy, then keep their newest ``stream_tokens`` (moved in residual form, never coded
        again)."""
        q = self.owner.plan.quantizer
        c0 = self.committed
        recent_from = target - recent_tokens(target, q.recent_length, self.owner.sink_length, self.dropped)
        recent = self.recent[kind]
        idx = list(self.streamed)
        store = self.stream_copies[kind]
        leaving = max(0, min(c0, recent_from) - (c0 - recent.length))  # the oldest recent copies
        if leaving:
            store.push(*_heads_of(recent.parts(0, leaving), idx))
        a, b = max(c0, self.owner.sink_length) - c0, min(recent_from, target) - c0
        if b > a:
            store.push(*_heads_of(self.residual[kind].parts(a, b), idx))
        kept = stream_tokens(target, q.stream_window, q.recent_length, self.owner.sink_length)
        store.drop_oldest(store.length - kept)

    def _free_before(self, kept: int) -> None:
        """Free every stored token before position ``kept`` (a group boundary): residual tokens
        that left the window before being committed, whole segments, and the leading groups of the
        segment that straddles ``kept`` (its kept tokens are copied out so the freed bytes are
        released, not held behind a view)."""
        if kept > self.committed:  # tokens never committed: dropped from the residual
            n = kept - self.committed
            for kind in KINDS:
                self.residual[kind].drop_oldest(n)
            del self.residual_labels[:n]
            self.committed = kept
        for kind in KINDS:
            segs = []
            for seg in self.segments[kind]:
                if seg.start + seg.length <= kept:
                    continue
                if seg.start < kept:
                    a = kept - seg.start
                    blocks = []
                    for block in seg.blocks:
                        part = block.token_range(a, block.length)
                        part.map_tensors(lambda t: t.clone())
                        blocks.append(part)
                    seg = Segment(seg.modality, kept, seg.length - a, blocks)
                segs.append(seg)
            self.segments[kind] = segs
        self.dropped = kept
        self._trim_recent()

    def stored_length(self) -> int:
        """Positions this layer holds (``T`` for a full layer; the kept window for a sliding one)."""
        return self.get_seq_length() - self.dropped

    # ------------------------------------------------------------------ introspection
    def nbytes_parts(self) -> dict[str, int]:
        parts = {"payload": 0, "scales_zeros": 0, "correction": 0, "residual": 0}
        if not self.is_initialized:
            return parts
        for kind in KINDS:
            parts["residual"] += self.residual[kind].nbytes + self.recent[kind].nbytes
            if self.stream_copies is not None:
                parts["residual"] += self.stream_copies[kind].nbytes
            for seg in self.segments[kind]:
                for block in seg.blocks:
                    for k, v in block.nbytes_parts().items():
                        parts[k] += v
        if self.heavy is not None:
            parts["residual"] += self.heavy.nbytes
        return parts

    def stored_token_bits(self) -> Counter:
        """Counter of ``(kind, modality, bits) -> token-heads`` over committed tokens (per batch row)."""
        c: Counter = Counter()
        for kind in KINDS:
            for seg in self.segments[kind]:
                for block in seg.blocks:
                    c[(kind, seg.modality, block.bits)] += block.length * len(block.heads)
        return c


class KVPlanCache(Cache):
    """A transformers ``Cache`` that stores K and V following a :class:`~kvplan.Plan`.

    Use through ``model.generate(cache=KVPlanCache(plan, model))`` or let
    :func:`kvplan.load` create one per ``generate`` call (a plan that streams KV heads needs
    ``kvplan.load`` either way: only kvplan's attention masks what they do not store, and a cache
    made for a model outside it is refused). :meth:`reset` empties it for the next prompt. Before the prefill, label the
    prompt's tokens with :meth:`assign_labels` (``kvplan.load`` does it from
    ``input_ids`` for VLMs; unlabelled and generated tokens are ``"text"``) and, for a
    left-padded batch, call :meth:`align_to_padding` with its attention mask (``kvplan.load``'s
    ``generate`` and :func:`kvplan.make_cache` do both for a cache they make).
    """

    def __init__(self, plan: Plan, model_or_geometry=None, attention_kernel=None):
        geometry = plan.geometry if model_or_geometry is None else Geometry.of(model_or_geometry)
        plan.check_geometry(geometry)
        if hasattr(model_or_geometry, "config"):
            _check_streaming_attention(plan, model_or_geometry)
        if plan.geometry.sliding_window is None and geometry.sliding_window is not None:
            # a plan written before windows were recorded: its sliding layers follow the model's window
            plan = plan.replace(geometry=geometry)
        self.plan = plan
        self.geometry = geometry
        # set when the model runs kvplan's fused attention (see runtime/fused.py)
        self.attention_kernel = attention_kernel
        # the text config whose attention must stay kvplan's while this cache is read (None: no model given,
        # or a cache the model's own attention reads): checked at each update, see check_attention
        needs_kvplan_attention = attention_kernel is not None or bool(plan.streamed_heads())
        self._attention_config = (text_config(model_or_geometry.config)
                                  if needs_kvplan_attention and hasattr(model_or_geometry, "config") else None)
        self.commits_paused = False
        # each row's left padding, set by align_to_padding (None: unpadded): by it a row's pre-RoPE key
        # frame trails the cache index, and grid_origin and sink_length follow from it
        self.row_padding: list[int] | None = None
        self.angle_tables: dict = {}  # RoPE angle tables of pre-RoPE keys, one per frequency set, all layers
        self._labels: list[str] = []
        # format codes [L, H_kv, 2, M] (bits, + CORRECTED if corrected), resolved from the rules once
        self.code_table = plan.code_table()
        super().__init__(layers=[KVPlanLayer(self, i) for i in range(geometry.num_layers)])

    def check_attention(self) -> None:
        """Refuse to be read by another attention than the one this cache was made for: made under
        kvplan's attention function (a fused kernel, or a plan that streams KV heads), it hands that
        function packed or masked states, which the model's own attention would read as the whole history
        (after ``kvplan.unload``, or ``kvplan.load`` on the dequantize route)."""
        config = self._attention_config
        if config is not None and config._attn_implementation != ATTENTION_NAME:
            route = getattr(self.attention_kernel, "__name__", None) or "kvplan's attention function"
            raise CacheError(f"this cache was made to be read by kvplan's attention ({route}), but the model now "
                             f"attends with {config._attn_implementation!r} (kvplan.unload, or kvplan.load with "
                             "another attention, since it was made): continue under the load it was made "
                             "under, or start on a new cache")

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the ``-tokens_to_remove`` newest tokens (transformers' ``Cache.crop``), which must still
        be in every layer's residual, leaving what the plan stores at the shorter length (see the layers'
        ``check_crop``); their modality labels go with them, so the next prompt's tokens at those positions
        are labelled anew. Nothing is removed when a layer cannot remove them."""
        for layer in self.layers:  # (a positive count is refused by the layers' crop, before any change)
            layer.check_crop(-tokens_to_remove)
        super().crop(tokens_to_remove)
        del self._labels[self.get_seq_length():]

    @property
    def grid_origin(self) -> int:
        """Where the token groups start (``grid_origin + k * group_size``,
        ``plans.accounting.committed_length``): the batch's longest left padding, 0 unpadded."""
        return max(self.row_padding) if self.row_padding else 0

    @property
    def sink_length(self) -> int:
        """Positions ``[0, sink_length)`` are held apart as attention sinks: the plan's ``sink_length``,
        moved past the longest left padding (:meth:`align_to_padding`); 0 for a plan without sinks."""
        sinks = self.plan.quantizer.sink_length
        return sinks + self.grid_origin if sinks else 0

    def pause_commits(self) -> None:
        """Stop quantizing further tokens: new tokens stay in the full-precision residual.

        For scoring: evaluated tokens must never be quantized, and nothing reads them again.
        """
        self.commits_paused = True

    def align_to_padding(self, attention_mask) -> None:
        """Store a left-padded batch's rows as the search stores an unpadded sequence.

        The search scores unpadded sequences: their first tokens are the sinks and their keys are
        quantized in the pre-RoPE frame of their own positions. In a batch whose rows are left-padded
        (``attention_mask [B, T]`` of the prompt, 0 = padding), the cache then keeps positions
        ``[0, P + S)`` apart as sinks, ``P`` the longest left padding of any row and ``S`` the plan's
        ``sink_length`` (the padding and the less-padded rows' extra tokens are held as sinks too, at
        ``quantizer.sink_bits``, counted by :meth:`nbytes`), starts the token groups at ``P``
        (``grid_origin``: the most-padded row commits, groups and frees its tokens exactly as it does
        alone; a sink-less plan codes the positions before ``P`` in groups of their own), and rotates row
        ``b``'s keys by its RoPE position, its cache index minus its padding
        (:meth:`Rotation.set_row_padding`). A no-op for unpadded prompts. Call before the prompt is
        written.
        """
        if attention_mask is None:
            return
        if self.get_seq_length():
            raise CacheError("align_to_padding: the cache already holds tokens; align it before the prompt is "
                             "written")
        mask = torch.as_tensor(attention_mask)
        if mask.dim() != 2:
            raise CacheError(f"align_to_padding: attention_mask must be [batch, tokens], got shape "
                             f"{list(mask.shape)}")
        leading = (mask.ne(0).long().cumsum(-1) == 0).sum(-1).tolist()  # [B]: padding before each row's first token
        self.row_padding = leading if any(leading) else None

    def reset(self) -> None:
        """Empty the cache for a new prompt, as freshly made: every layer's tokens, and the prompt state
        the last prompt set (its row padding from :meth:`align_to_padding`, its labels from
        :meth:`assign_labels`, :meth:`pause_commits`)."""
        super().reset()
        self.row_padding = None
        self.angle_tables = {}  # made again at the next prompt, from its own padding
        self._labels = []
        self.commits_paused = False

    # ------------------------------------------------------------------ modality labels
    def assign_labels(self, labels: Sequence[str] | Sequence[Sequence[str]], attention_mask=None) -> None:
        """Label the next tokens written to the cache (positions from the current length on).

        ``labels``: one label per token, or one list per batch row (``[B][T]``). With rows,
        padded positions (``attention_mask == 0``) take the label of the other rows; rows
        that disagree at a position raise :class:`CacheError` (mixed layouts in one batch
        are not supported: run them as separate batches).
        """
        if labels and not isinstance(labels[0], str):
            labels = resolve_batch_labels(labels, attention_mask)
        start = self.get_seq_length()
        if len(self._labels) > start:
            del self._labels[start:]
        while len(self._labels) < start:
            self._labels.append(TEXT)
        self._labels.extend(self._plan_label(x, start + i) for i, x in enumerate(labels))

    def has_labels_from(self, position: int) -> bool:
        """Whether labels were assigned for the token at ``position`` (by :meth:`assign_labels`)."""
        return len(self._labels) > position

    def _plan_label(self, label: str, position: int) -> str:
        mods = self.plan.modalities
        if label in mods:
            return label
        if len(mods) == 1:  # a modality-agnostic plan stores every token the same way
            return mods[0]
        raise PlanError("modalities", f"token at position {position} is labelled {label!r}, which the plan "
                        f"does not cover (plan modalities: {list(mods)})", label)

    def check_prompt_labelled(self, start: int, n: int) -> None:
        """Refuse a prompt (``n > 1`` tokens from position 0) written to a cache with no labels when the
        plan has several modalities: nothing would tell its visual tokens apart (each would be stored at
        the text bits). Tokens written later, one by one or after a labelled prompt, are ``text``."""
        if not self._labels and start == 0 and n > 1 and len(self.plan.modalities) > 1:
            raise CacheError(f"a {n}-token prompt reached a cache with no modality labels, and the plan stores "
                             f"{list(self.plan.modalities)} at different bits: make the cache with "
                             "make_cache(model, plan, input_ids), call cache.assign_labels first, or generate "
                             "under kvplan.load (which labels the prompt)")

    def labels_for(self, start: int, n: int) -> list[str]:
        """Labels of positions ``[start, start + n)``: assigned ones, else ``text`` (generated tokens)."""
        default = self._plan_label(TEXT, start)
        return [self._labels[i] if i < len(self._labels) else default for i in range(start, start + n)]

    # ------------------------------------------------------------------ memory
    def nbytes_breakdown(self) -> dict[str, int]:
        """Bytes held now: ``payload`` (codes, 16-bit slots), ``scales_zeros``, ``correction`` (key
        correction codes), ``residual``, ``total``."""
        parts = {"payload": 0, "scales_zeros": 0, "correction": 0, "residual": 0}
        for layer in self.layers:
            for k, v in layer.nbytes_parts().items():
                parts[k] += v
        parts["total"] = sum(parts.values())
        return parts

    def nbytes(self) -> int:
        """Total bytes of K/V storage held by the cache (stored tokens; the growth buffers behind
        committed blocks may hold up to 50% more, see :mod:`kvplan.runtime.storage`)."""
        return self.nbytes_breakdown()["total"]

    def num_values(self) -> int:
        """Number of cached K/V values (``2 * B * H_kv * D`` times the positions each layer holds:
        ``T`` for full layers, the kept window for sliding-window layers)."""
        total = 0
        for layer in self.layers:
            if layer.is_initialized:
                r = layer.residual["k"]
                total += 2 * r.shape[0] * r.shape[1] * layer.stored_length() * r.shape[-1]
        return total

    def bpv(self) -> float:
        """Measured honest bits per value: ``8 * nbytes() / num_values()``."""
        n = self.num_values()
        return 8 * self.nbytes() / n if n else 0.0

    def stored_token_bits(self) -> Counter:
        """Counter ``(kind, modality, bits) -> token-heads`` committed, summed over layers."""
        c: Counter = Counter()
        for layer in self.layers:
            c.update(layer.stored_token_bits())
        return c

    def token_bits(self, layer: int, kind: str) -> list[list[int]]:
        """Bits each committed token is stored at, per KV head: ``[H_kv][T_committed]``."""
        lay = self.layers[layer]
        out = [[] for _ in range(self.geometry.num_kv_heads)]
        for seg in lay.segments[kind]:
            for block in seg.blocks:
                for h in block.heads:
                    out[h].extend([block.bits] * seg.length)
        return out


def _check_streaming_attention(plan: Plan, model) -> None:
    """Refuse a plan that streams KV heads (bits 0) for a model not running kvplan's attention
    function: only it masks the committed positions those heads store nothing for (another
    attention would read them as zeros, silently)."""
    if not plan.streamed_heads():
        return
    config = model.config
    config = text_config(config)
    if config._attn_implementation != ATTENTION_NAME:
        if getattr(model, "kvplan_plan", None) is not None:  # loaded, then switched by the user
            raise PlanError("bits", "the plan streams KV heads (bits 0), which only kvplan's attention masks, but "
                            f"this model now attends with {config._attn_implementation!r} although kvplan.load put "
                            "it on kvplan's attention (set_attn_implementation since?): kvplan.load the plan again",
                            show_value=False)
        raise PlanError("bits", "the plan streams KV heads (bits 0), which only kvplan's attention masks: run "
                        "the model under kvplan.load(model, plan) (or kvplan.runtime.attention_route(model, "
                        "attention, plan)) before making its cache", show_value=False)


def _heads_of(parts: tuple, idx: list[int]) -> tuple:
    """``(codes or None, uncoded [B, H_kv, n, D])`` of :meth:`Residual.parts` restricted to the KV heads
    ``idx`` (copies; the codes' heads renumbered ``0 .. len(idx) - 1``)."""
    sealed, fresh = parts
    if sealed is not None:
        sealed = replace(sealed, heads=tuple(range(len(idx))))
        sealed.map_tensors(lambda t: t[:, idx])
    return sealed, fresh[:, idx]


def resolve_batch_labels(rows: Sequence[Sequence[str]], attention_mask=None) -> list[str]:
    """One label per position from per-row labels, ignoring padded positions."""
    n = len(rows[0])
    if any(len(r) != n for r in rows):
        raise CacheError("modality label rows have different lengths")
    mask = None if attention_mask is None else torch.as_tensor(attention_mask).tolist()
    out = []
    for t in range(n):
        seen = {rows[b][t] for b in range(len(rows)) if mask is None or mask[b][t]}
        if len(seen) > 1:
            raise CacheError(
                f"batch rows disagree on the modality of position {t} ({sorted(seen)}); kvplan stores one modality "
                "per position across a batch: run prompts whose labels sit at different positions (images, or a "
                "labelling by position under different padding) as separate batches"
            )
        out.append(seen.pop() if seen else TEXT)
    return out
