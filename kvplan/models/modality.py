"""Token modality labels: which prompt tokens are visual and which are text."""

from __future__ import annotations

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
