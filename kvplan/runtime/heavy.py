"""Heavy-hitter copies (``quantizer.heavy_length``): each KV head's most-attended committed tokens,
read back at the residual's precision instead of from their slot codes.

Which tokens: a prompt's last :data:`HEAVY_WINDOW` queries show which of its tokens the following
ones attend to (SnapKV's observation window; ``bench/attention_protection_probe.py`` measured the
rule against more recent copies, key statistics and the evaluated tokens' own attention). When a
forward writes a layer and commits tokens, those tokens wait as *candidates* -- coded at the
residual's precision, as :class:`~kvplan.runtime.storage.Residual` codes them, with their positions
-- until that forward's attention call scores them (:meth:`HeavyCopies.resolve` with
:func:`window_mass`: the softmax probability the window's queries, and the query heads sharing the
KV head, give each token, summed). Each KV head then keeps its ``heavy_length`` best-scored tokens
among its held copies and the candidates (ties: the newest first). Tokens committed with no scoring
forward (decode steps: forwards of at most ``MAX_FUSED_QUERY`` tokens once the layer has committed any, on
every attention route; or writes without kvplan's attention) are unscored candidates (score -1,
below every probability): they fill free places and never displace a scored copy. The number of
copies is therefore :func:`kvplan.plans.accounting.heavy_tokens` at every length, whatever the scores.

Full-attention layers only; sink positions are never candidates (they are stored apart already).
A copy replaces only reads of a quantized slot: a 16-bit slot reads its own exact token.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import replace

import torch

from ..kernels import FULL_PRECISION_BITS
from ..models.geometry import text_config
from .storage import PackedBlock, Residual

# queries at the end of a prompt whose attention chooses the copies (SnapKV's observation window)
HEAVY_WINDOW = 32
# the attention function recording_window_queries registers for the length of a prefill
RECORDER_NAME = "kvplan_record_window"


def window_mass(query: torch.Tensor, keys: torch.Tensor, scaling: float,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, H_kv, T_k]`` fp32: per key, the softmax probability that the last ``HEAVY_WINDOW``
    queries of ``query [B, Hq, Tq, D]`` (the newest ``Tq`` of the ``T_k`` positions of ``keys [B,
    H_kv, T_k, D]``) and the query heads sharing its KV head give it, summed. ``attention_mask``: the
    forward's bool (True = attend) or additive mask ``[B or 1, 1 or Hq, Tq, T_k]``; ``None``: causal."""
    B, Hq, Tq, D = query.shape
    H, Tk = keys.shape[1], keys.shape[2]
    rep, w = Hq // H, min(HEAVY_WINDOW, Tq)
    qw = query[:, :, Tq - w:].float().reshape(B, H, rep * w, D)  # query head j reads KV head j // rep
    s = torch.matmul(qw, keys.float().transpose(-1, -2)).mul_(float(scaling)).view(B, H, rep, w, Tk)
    if attention_mask is None:
        q_pos = torch.arange(Tk - w, Tk, device=keys.device)
        s.masked_fill_(torch.arange(Tk, device=keys.device)[None, :] > q_pos[:, None], float("-inf"))
    else:
        m = attention_mask[:, :, Tq - w:]
        m = m.reshape(m.shape[0], H, rep, w, Tk) if m.shape[1] == Hq else m.reshape(m.shape[0], 1, 1, w, Tk)
        if m.dtype == torch.bool:
            s.masked_fill_(~m, float("-inf"))
        else:
            s.add_(m.float())
    return torch.softmax(s, dim=-1).nan_to_num_(0.0).sum(dim=(2, 3))


def _cat(a, b):
    """Two stores (tensors ``[B, H, t, D]`` or token-axis :class:`PackedBlock` s) one after the other."""
    if a is None:
        return b
    if torch.is_tensor(a):
        return torch.cat([a, b], dim=2)
    cat = lambda x, y: None if x is None else torch.cat([x, y], dim=2)  # noqa: E731
    return replace(a, codes=cat(a.codes, b.codes), scale=cat(a.scale, b.scale), zero=cat(a.zero, b.zero),
                   length=a.length + b.length)


def _mapped(store, fn):
    """A store (tensor or :class:`PackedBlock`) with ``fn`` applied to every tensor it holds."""
    if torch.is_tensor(store):
        return fn(store)
    store.map_tensors(fn)
    return store


def _nbytes(store) -> int:
    return store.nbytes if torch.is_tensor(store) else sum(store.nbytes_parts().values())


def _select(store, idx: torch.Tensor):
    """Tokens ``idx [B, H, m]`` (per batch row and head) of a store, copied (codes are not coded again)."""
    def take(t):
        if t is None:
            return None
        shape = (*idx.shape, *([1] * (t.dim() - 3)))
        return t.gather(2, idx.view(shape).expand(*idx.shape, *t.shape[3:])).contiguous()

    if torch.is_tensor(store):
        return take(store)
    return replace(store, codes=take(store.codes), scale=take(store.scale), zero=take(store.zero),
                   length=idx.shape[-1])


class HeavyCopies:
    """The heavy-hitter copies of one full-attention layer: ``positions`` (int32 ``[B, H_kv, m]``),
    ``scores`` (fp32, what chose them) and per kind the copies (``[B, H_kv, m, D]``: per-token codes at
    ``bits``, or as written at 16 bits); ``m <= n`` is the same for every head."""

    def __init__(self, n: int, bits: int, group_size: int):
        self.n, self.bits, self.group_size = n, bits, group_size
        self.positions: torch.Tensor | None = None
        self.scores: torch.Tensor | None = None
        self.copies: dict = {"k": None, "v": None}
        self._candidates: tuple | None = None  # (positions int64 [t], {kind: store [B, H, t, ...]})
        self.slots_quantized: torch.Tensor | None = None  # set by the layer (KVPlanLayer.heavy_reads)

    @property
    def length(self) -> int:
        return 0 if self.positions is None else self.positions.shape[-1]

    @property
    def pending(self) -> bool:
        """Whether committed tokens wait for a score."""
        return self._candidates is not None

    def add_candidates(self, first: int, parts: dict) -> None:
        """Tokens ``[first, first + t)`` that just committed, as the residual stored them: per kind
        ``(codes or None, uncoded [B, H_kv, n, D])`` (:meth:`Residual.parts`); uncoded ones are coded
        at ``bits`` now (their first coding, as the residual would have coded them)."""
        stores = {}
        for kind, (sealed, fresh) in parts.items():
            store = None if sealed is None else Residual._copied(replace(sealed))  # (coded: bits < 16)
            if fresh.shape[-2]:
                if self.bits == FULL_PRECISION_BITS:
                    coded = fresh.clone()
                else:
                    coded = PackedBlock.encode(fresh, tuple(range(fresh.shape[1])), self.bits, "token",
                                               self.group_size, 0)
                store = _cat(store, coded)
            stores[kind] = store
        t = stores["k"].shape[2] if torch.is_tensor(stores["k"]) else stores["k"].length
        positions = torch.arange(first, first + t, device=fresh.device)
        if self._candidates is not None:
            old_pos, old = self._candidates
            positions = torch.cat([old_pos, positions])
            stores = {kind: _cat(old[kind], stores[kind]) for kind in stores}
        self._candidates = (positions, stores)

    def resolve(self, mass: torch.Tensor | None = None, first: int = 0) -> None:
        """Score the candidates with ``mass [B, H_kv, T']`` (positions ``first ..``; ``None``: unscored,
        -1) and keep each head's ``n`` best of copies and candidates (ties: the newest)."""
        if self._candidates is None:
            return
        cand_pos, stores = self._candidates
        self._candidates = None
        k0 = stores["k"]
        B, H = (k0.shape[0], k0.shape[1]) if torch.is_tensor(k0) else k0.codes.shape[:2]
        t = cand_pos.shape[0]
        if mass is None:
            cand_score = torch.full((B, H, t), -1.0, device=cand_pos.device)
        else:
            cand_score = mass[:, :, cand_pos - first].float()
        pos = cand_pos.expand(B, H, t)
        score = cand_score
        if self.positions is not None:
            pos = torch.cat([self.positions.long(), pos], dim=-1)
            score = torch.cat([self.scores, cand_score], dim=-1)
        newest_first = torch.sort(pos, dim=-1, descending=True, stable=True).indices
        by_score = torch.sort(score.gather(-1, newest_first), dim=-1, descending=True, stable=True).indices
        keep = newest_first.gather(-1, by_score)[..., : min(self.n, pos.shape[-1])]
        self.positions = pos.gather(-1, keep).to(torch.int32)
        self.scores = score.gather(-1, keep).contiguous()
        for kind, store in stores.items():
            self.copies[kind] = _select(_cat(self.copies[kind], store), keep)

    def read(self, kind: str, dtype: torch.dtype) -> torch.Tensor:
        """The copies of ``kind`` as read: ``[B, H_kv, m, D]`` in ``dtype``."""
        store = self.copies[kind]
        return store.to(dtype) if torch.is_tensor(store) else store.decode(dtype)

    @property
    def nbytes(self) -> int:
        """Bytes held: the copies' codes (or tensors), scales and zero-points, their positions and
        scores, and any candidates still waiting for a score."""
        n = sum(_nbytes(s) for s in self.copies.values() if s is not None)
        if self._candidates is not None:
            n += sum(_nbytes(s) for s in self._candidates[1].values())
        if self.positions is not None:
            n += self.positions.nbytes + self.scores.nbytes
        return n

    def map_tensors(self, fn) -> None:
        """Apply ``fn`` to every stored tensor (batch dim first), e.g. for beam reordering."""
        if self.positions is not None:
            self.positions, self.scores = fn(self.positions), fn(self.scores)
        self.copies = {kind: None if s is None else _mapped(s, fn) for kind, s in self.copies.items()}
        if self._candidates is not None:
            positions, stores = self._candidates
            self._candidates = (positions, {kind: _mapped(s, fn) for kind, s in stores.items()})


@contextmanager
def recording_window_queries(model, out: dict):
    """Inside the block, every attention call of ``model``'s text decoder also stores
    ``out[layer_idx] = (its last HEAVY_WINDOW queries [B, Hq, w, D], scaling, their mask rows [B, 1 or
    Hq, w, T_k] or None)``: the mask is the forward's own (a VLM's bidirectional image blocks, a sliding
    window), as kvplan's attention function sees it at a deployed prompt. The attention itself is the
    model's own (same function, same masks: the same numbers)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from .fused import set_text_attention

    cfg = text_config(model.config)
    impl = cfg._attn_implementation

    def recorder(module, query, key, value, attention_mask, scaling=None, **kwargs):
        rows = None if attention_mask is None else attention_mask[:, :, -HEAVY_WINDOW:].detach().clone()
        out[module.layer_idx] = (query[:, :, -HEAVY_WINDOW:].detach().clone(), scaling, rows)
        if impl in ALL_ATTENTION_FUNCTIONS:
            fn = ALL_ATTENTION_FUNCTIONS[impl]
        else:  # "eager": the modeling module's own function
            fn = sys.modules[type(module).__module__].eager_attention_forward
        return fn(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    AttentionInterface.register(RECORDER_NAME, recorder)
    AttentionMaskInterface.register(RECORDER_NAME, ALL_MASK_ATTENTION_FUNCTIONS[impl])
    set_text_attention(model, RECORDER_NAME)
    try:
        yield out
    finally:
        set_text_attention(model, impl)

