"""Token modality labels: which prompt tokens are visual and which are text.

A :class:`Labelling` gives every prompt token a modality label, the same way when the search
scores plans and when :func:`kvplan.load` deploys them. The default, :data:`TOKEN_IDS`, labels
a VLM's image and video token ids ``"visual"`` and every other token ``"text"``. A user who
labels tokens another way (code vs prose, retrieved vs asked...) wraps a function in a
:class:`Labelling` and passes the same object to the search and to ``kvplan.load``; the plan
records its ``name``, and ``kvplan.load`` refuses a plan searched with another labelling.
"""

from __future__ import annotations

from typing import Callable, Sequence

from ..errors import KVPlanError

TEXT = "text"
VISUAL = "visual"

_VISUAL_TOKEN_KEYS = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")


def visual_token_ids(config) -> set[int]:
    """Token ids that stand for image or video patches in a VLM's ``input_ids``."""
    ids = set()
    for key in _VISUAL_TOKEN_KEYS:
        v = getattr(config, key, None)
        if isinstance(v, int):
            ids.add(v)
    return ids


def labels_from_input_ids(input_ids, config) -> list[list[str]]:
    """Per-row labels ``[B][T]``: ``"visual"`` where ``input_ids`` is an image/video token."""
    vis = visual_token_ids(config)
    rows = input_ids.tolist()
    return [[VISUAL if t in vis else TEXT for t in row] for row in rows]


class LabellingError(KVPlanError, ValueError):
    """A labelling function returned labels of the wrong shape or outside its modalities."""


class Labelling:
    """How prompt tokens get their modality labels, at search and at deployment alike.

    ``fn(input_ids, config) -> labels``: ``input_ids`` a ``LongTensor [B, T]`` (batch rows of a
    prompt), ``config`` the model's config; returns one list of ``T`` labels per row.
    ``modalities``: every label it can give; must include ``"text"`` (generated tokens are
    text). ``name``: what plans searched with it record (default ``module.qualname`` of
    ``fn``; required for a lambda or a nested function, whose qualname does not tell it from others);
    :func:`kvplan.load` compares it with the plan's ``labelling``.
    """

    def __init__(self, fn: Callable, modalities: Sequence[str], name: str | None = None):
        if not callable(fn):
            raise LabellingError(f"labelling: expected a function (input_ids, config) -> labels, got {type(fn).__name__}")
        mods = tuple(modalities)
        if TEXT not in mods or len(set(mods)) != len(mods) or not all(isinstance(m, str) and m for m in mods):
            raise LabellingError(f"labelling modalities {list(mods)}: must be distinct non-empty names including "
                                 f"{TEXT!r} (generated tokens are text)")
        qualname = getattr(fn, "__qualname__", type(fn).__name__)
        if name is None and ("<lambda>" in qualname or "<locals>" in qualname):
            raise LabellingError(f"labelling {qualname!r}: a lambda or a function defined inside another gets no "
                                 "name that tells it from others like it (the name is all a plan records and "
                                 "kvplan.load compares): pass name=")
        self.fn = fn
        self._modalities = mods
        self.name = name or f"{getattr(fn, '__module__', '?')}.{qualname}"
        if self.name == TOKEN_IDS_NAME and type(self) is Labelling:
            raise LabellingError(f"labelling name {TOKEN_IDS_NAME!r} is the default labelling's; choose another")

    def modalities(self, config) -> tuple[str, ...]:
        """The labels this labelling can give prompts of a model with ``config``."""
        return self._modalities

    def __call__(self, input_ids, config, attention_mask=None) -> list[list[str]]:
        """Labels ``[B][T]`` of ``input_ids [B, T]``, checked (shape, names). With an ``attention_mask``
        that pads some row, each row is labelled on its own tokens alone, as the search labels a prompt
        (a labelling by position counts from the row's first token, not from its padding); padded
        positions get ``"text"``."""
        if attention_mask is not None:
            import torch

            keep = torch.as_tensor(attention_mask).to(torch.bool)  # [B, T]
            if not bool(keep.all()):
                rows = [[TEXT] * keep.shape[1] for _ in range(keep.shape[0])]
                for b in range(keep.shape[0]):
                    where = keep[b].nonzero().flatten().tolist()
                    if where:
                        for t, lab in zip(where, self(input_ids[b : b + 1, keep[b]], config)[0]):
                            rows[b][t] = lab
                return rows
        rows = self.fn(input_ids, config)
        B, T = input_ids.shape
        rows = [list(r) for r in rows]
        if len(rows) != B or any(len(r) != T for r in rows):
            raise LabellingError(f"labelling {self.name!r}: returned {len(rows)} rows of lengths "
                                 f"{sorted({len(r) for r in rows})} for input_ids of shape [{B}, {T}]")
        allowed = set(self.modalities(config))
        if set().union(*rows) - allowed:  # name the first wrong label
            b, t, lab = next((b, t, lab) for b, r in enumerate(rows) for t, lab in enumerate(r) if lab not in allowed)
            raise LabellingError(f"labelling {self.name!r}: label {lab!r} at row {b}, token {t} is not one "
                                 f"of its modalities {sorted(allowed)}")
        return rows

    def __repr__(self) -> str:
        return f"Labelling({self.name!r})"


TOKEN_IDS_NAME = "token-ids"


class _TokenIdLabelling(Labelling):
    """The default: image/video token ids of a VLM -> ``"visual"``, every other token ``"text"``."""

    def __init__(self):
        super().__init__(labels_from_input_ids, (TEXT, VISUAL), name=TOKEN_IDS_NAME)

    def modalities(self, config) -> tuple[str, ...]:
        return (TEXT, VISUAL) if visual_token_ids(config) else (TEXT,)

    def __call__(self, input_ids, config, attention_mask=None) -> list[list[str]]:
        # correct by construction (no check per token); by token id alone, so padding moves nothing
        return labels_from_input_ids(input_ids, config)


TOKEN_IDS = _TokenIdLabelling()


def resolve_labelling(labelling: Labelling | None) -> Labelling:
    """``labelling``, or the default :data:`TOKEN_IDS` for ``None``."""
    if labelling is None:
        return TOKEN_IDS
    if not isinstance(labelling, Labelling):
        raise LabellingError(f"labelling: expected a kvplan Labelling, got {type(labelling).__name__}; wrap a "
                             "function as kvplan.Labelling(fn, modalities=[...])")
    return labelling
