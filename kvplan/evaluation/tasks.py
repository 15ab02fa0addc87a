"""Evaluation tasks: the built-in offline documentation task and user JSONL tasks.

Default task (``"default"``, text only): CPython's offline documentation
(``pydoc_data.topics``). Each sample is

    [system + user header: label "text"] [a window of one topic's text: label "doc"]

followed by the next ``eval_tokens`` tokens of the same topic (the evaluated continuation)
and a multiple-choice *phrase recall* question whose answer needs the history: the
question quotes ``cue_tokens`` tokens of the history and asks which phrase came next; the
four options are the true next ``option_tokens`` tokens and three other spans of the same
history window (so an option's prior plausibility gives no hint).

Splits are made over source *topics* (topics whose text is a copy of a part of another
topic are dropped), assigned by a hash of the topic name: ``calibration`` and ``heldout``
never share a topic. Everything is deterministic given the arguments.

User task: JSONL lines ``{"history": str, "images": [paths] (optional), "question": str,
"choices": [str] (optional), "answer": str | int (optional)}``; VLM prompts go through the
model's processor and image/video tokens are labelled ``"visual"``.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from functools import lru_cache
from typing import Any, Sequence

import torch

from ..models.modality import labels_from_input_ids
from .harness import Sample

DOC = "doc"
TEXT = "text"
SPLITS = ("calibration", "heldout")

SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
HEADER = ("<|im_start|>system\n" + SYSTEM_PROMPT + "<|im_end|>\n<|im_start|>user\n"
          "Here is a section of the Python documentation:\n\n")
QUESTION = "<|im_end|>\n<|im_start|>user\nQuote the text above.<|im_end|>\n<|im_start|>assistant\n"


# ----------------------------------------------------------------------------- sources and splits
@lru_cache(maxsize=1)
def doc_sources() -> tuple[tuple[str, str], ...]:
    """``(topic, text)`` of pydoc topics, dropping topics whose opening is contained in another topic."""
    from pydoc_data.topics import topics

    items = sorted(topics.items())
    keep = []
    for name, text in items:
        lines = text.strip().split("\n")
        if len(lines) > 2 and lines[1] and set(lines[1]) <= set("*=-~^"):  # skip a title + underline
            lines = lines[2:]
        head = "\n".join(lines).strip()[:200]
        if any(other != name and len(t) > len(text) and head in t for other, t in items):
            continue  # a section duplicated inside a longer topic (e.g. 'customization' in 'specialnames')
        keep.append((name, text))
    return tuple(keep)


def _hash(s: str) -> int:
    return int(hashlib.sha256(s.encode()).hexdigest()[:12], 16)


def split_of(topic: str) -> str:
    """Deterministic split of a topic: by its name's hash."""
    return SPLITS[_hash("kvplan-split:" + topic) % 2]


def doc_split_topics(split: str) -> list[str]:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    return [name for name, _ in doc_sources() if split_of(name) == split]


# ----------------------------------------------------------------------------- default task
def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _mc_phrase(doc_ids: list[int], rng: random.Random, cue: int, opt: int, n_options: int):
    """Pick a cue span with a unique occurrence in the history and distractor spans of the same history."""
    T = len(doc_ids)
    lo = cue + 1
    for _ in range(200):
        p = rng.randrange(lo, T - opt)  # the answer span is doc_ids[p:p+opt], cue is doc_ids[p-cue:p]
        cue_ids = doc_ids[p - cue:p]
        occ = sum(1 for i in range(cue, T + 1) if doc_ids[i - cue:i] == cue_ids)
        if occ != 1:
            continue
        answer = doc_ids[p:p + opt]
        opts = [answer]
        tries = 0
        while len(opts) < n_options and tries < 500:
            tries += 1
            q = rng.randrange(0, T - opt)
            span = doc_ids[q:q + opt]
            if abs(q - p) >= opt and all(span != o for o in opts) and span[0] != answer[0]:
                opts.append(span)
        if len(opts) < n_options:
            continue
        order = list(range(n_options))
        rng.shuffle(order)
        options = [opts[i] for i in order]
        return cue_ids, options, order.index(0), p
    return None


def default_task_samples(tokenizer, split: str = "heldout", n: int = 16, history_tokens: int = 512,
                         eval_tokens: int = 32, cue_tokens: int = 8, option_tokens: int = 6, n_options: int = 4,
                         seed: int = 0) -> list[Sample]:
    """Samples of the built-in documentation task (see module docstring).

    ``history_tokens`` counts the whole history (header + document window). Windows of a
    topic do not overlap; samples go round-robin over the split's topics.
    """
    header = _encode(tokenizer, HEADER)
    question = _encode(tokenizer, QUESTION)
    doc_len = history_tokens - len(header)
    if doc_len < 4 * (cue_tokens + option_tokens):
        raise ValueError(f"history_tokens={history_tokens} is too short (header alone is {len(header)} tokens)")
    need = doc_len + eval_tokens
    windows: list[list[tuple[str, int, list[int]]]] = []
    for topic in doc_split_topics(split):
        text = dict(doc_sources())[topic]
        ids = _encode(tokenizer, text)
        ws = [(topic, o, ids[o:o + need]) for o in range(0, len(ids) - need + 1, need)]
        if ws:
            windows.append(ws)
    order = []
    depth = max((len(w) for w in windows), default=0)
    for j in range(depth):
        order += [w[j] for w in windows if j < len(w)]
    if n > len(order):
        raise ValueError(f"split {split!r} has only {len(order)} windows of {need} tokens; ask for fewer samples "
                         "or a shorter history")
    samples = []
    for topic, offset, ids in order[:n]:
        doc = ids[:doc_len]
        rng = random.Random(_hash(f"{seed}:{topic}:{offset}"))
        mc = _mc_phrase(doc, rng, cue_tokens, option_tokens, n_options)
        q_ids = options = answer = None
        if mc is not None:
            cue_ids, options, answer, _ = mc
            q_ids = question + cue_ids
        sid = f"{topic}@{offset}"
        samples.append(Sample(
            history_ids=header + doc,
            history_labels=[TEXT] * len(header) + [DOC] * len(doc),
            eval_ids=ids[doc_len:doc_len + eval_tokens],
            question_ids=q_ids, options=options, answer=answer,
            meta={"id": sid, "topic": topic, "offset": offset, "split": split, "task": "default"},
        ))
    return samples


# ----------------------------------------------------------------------------- user JSONL task
def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not valid JSON ({e.msg})") from None
            for key in ("history", "question"):
                if not isinstance(rec.get(key), str):
                    raise ValueError(f"{path}:{i}: field {key!r} must be a string")
            unknown = set(rec) - {"history", "images", "question", "choices", "answer", "id"}
            if unknown:
                raise ValueError(f"{path}:{i}: unknown fields {sorted(unknown)}")
            rec.setdefault("id", f"{os.path.basename(os.fspath(path))}:{i}")
            rec["_base"] = os.path.dirname(os.path.abspath(path))
            rows.append(rec)
    return rows


def _tokenizer_of(processor):
    return getattr(processor, "tokenizer", processor)


def _load_image(path: str, base: str):
    from PIL import Image

    full = path if os.path.isabs(path) else os.path.join(base, path)
    return Image.open(full).convert("RGB")


def encode_user_record(rec: dict[str, Any], model, processor) -> Sample:
    """One JSONL record -> :class:`Sample`. Images are placed before the history text."""
    tok = _tokenizer_of(processor)
    images = [_load_image(p, rec.get("_base", ".")) for p in rec.get("images") or []]
    if images:
        image_token = getattr(processor, "image_token", None)
        if image_token is None:
            raise ValueError(f"record {rec.get('id')}: has images but the processor has no image token")
        # one image placeholder per image, each on its own line (separate runs of visual tokens)
        text = "".join(image_token + "\n" for _ in images) + rec["history"]
        enc = processor(text=[text], images=images, return_tensors="pt")
        ids = enc["input_ids"][0].tolist()
        extra = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
    else:
        ids = _encode(tok, rec["history"])
        extra = {}
    labels = labels_from_input_ids(torch.tensor([ids]), model.config)[0]
    q_ids = _encode(tok, "\n" + rec["question"])
    choices = rec.get("choices")
    answer = rec.get("answer")
    options = ans_idx = None
    if choices:
        options = [_encode(tok, " " + str(c)) for c in choices]
        if answer is not None:
            ans_idx = answer if isinstance(answer, int) else [str(c) for c in choices].index(str(answer))
        eval_ids = q_ids
    else:
        eval_ids = q_ids + (_encode(tok, " " + str(answer)) if answer is not None else [])
    return Sample(ids, labels, eval_ids, question_ids=q_ids if options else None, options=options,
                  answer=ans_idx, prefill_inputs=extra, meta={"id": rec.get("id"), "task": "jsonl"})


def user_task_samples(path: str | os.PathLike, model, processor, n: int | None = None) -> list[Sample]:
    recs = read_jsonl(path)
    if n is not None:
        recs = recs[:n]
    return [encode_user_record(r, model, processor) for r in recs]


def task_samples(task: str, model, processor, split: str = "heldout", n: int = 16, **kwargs) -> list[Sample]:
    """Samples of ``task``: ``"default"`` or a path to a JSONL file."""
    if task == "default":
        return default_task_samples(_tokenizer_of(processor), split=split, n=n, **kwargs)
    if os.path.exists(task):
        return user_task_samples(task, model, processor, n=n)
    raise ValueError(f"unknown task {task!r}: expected 'default' or a path to a JSONL file")


def pad_token_id(processor) -> int:
    tok = _tokenizer_of(processor)
    for attr in ("pad_token_id", "eos_token_id"):
        v = getattr(tok, attr, None)
        if isinstance(v, int):
            return v
    return 0


def summarize_labels(samples: Sequence[Sample]) -> dict[str, int]:
    from collections import Counter

    c: Counter = Counter()
    for s in samples:
        c.update(s.history_labels)
    return dict(c)
