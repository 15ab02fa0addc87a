"""Evaluation tasks: the built-in offline documentation task and user JSONL tasks.

Default task (``"default"``, text only): CPython's offline documentation
(``pydoc_data.topics``). Each sample is

    [system + user header] [a window of one topic's text]

every history token labelled ``"text"``: the label :func:`kvplan.load` gives every prompt
token of a text model, so a plan searched on this task is the plan users deploy (a
``"doc"`` label for the document part would shape plans no deployment can reproduce).

followed by the next ``eval_tokens`` tokens of the same topic (the evaluated continuation)
and a multiple-choice *phrase recall* question whose answer needs the history: the
question quotes ``cue_tokens`` tokens of the history and asks which phrase came next; the
four options are the true next ``option_tokens`` tokens and three other spans of the same
history window (so an option's prior plausibility gives no hint).

Splits: ``calibration`` (the search sees only this), ``validation`` (every setting or
default chosen by measurement is chosen here) and ``test`` (reported, never used to choose;
``"heldout"`` is accepted as its old name). The default task splits over source *topics*
(topics whose text is a copy of a part of another topic are dropped), assigned by a hash of
the topic name, so no two splits share a topic. Everything is deterministic given the
arguments.

User task: JSONL lines ``{"history": str, "images": [paths] (optional), "video": [frame paths]
(optional: one clip, its frames in order, all of one size), "question": str, "choices": [str]
(optional), "answer": str | int (optional), "id": str (optional)}``; the images, then the clip,
come before the history text. VLM prompts go through the model's processor (its image and video
tokens expanded as the processor expands them) and image/video tokens are labelled ``"visual"``
(the runtime's default labelling, :data:`kvplan.models.modality.TOKEN_IDS`, or the
:class:`~kvplan.Labelling` given). Records are
split by a hash of ``(seed, id)``: half calibration, a quarter validation, a quarter test.
"""

from __future__ import annotations

import hashlib
import json
import numbers
import os
import random
from dataclasses import replace
from functools import lru_cache
from typing import Any, Mapping, Sequence

import torch

from ..errors import KVPlanError, check_seed
from ..models.modality import Labelling, resolve_labelling
from .harness import Sample

TEXT = "text"
SPLITS = ("calibration", "validation", "test")
SPLIT_ALIASES = {"heldout": "test"}  # the test split's name before there was a validation split
ALL_RECORDS = "all"  # not a split: every record of a JSONL task (kvplan eval on data never searched on)
DEFAULT_HISTORY_TOKENS = 512  # the built-in task's history length per sample
DEFAULT_EVAL_TOKENS = 32  # the built-in task's evaluated tokens per sample


class TaskError(KVPlanError, ValueError):
    """A task file or task option is unusable (names the file, line and field)."""


def canonical_split(split: str) -> str:
    """``split`` checked and with old names mapped (``"heldout"`` -> ``"test"``)."""
    split = SPLIT_ALIASES.get(split, split)
    if split not in SPLITS:
        raise TaskError(f"unknown split {split!r}; expected one of {list(SPLITS)}")
    return split

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
    """Deterministic split of a topic: by its name's hash (about a third each)."""
    return SPLITS[_hash("kvplan-split3:" + topic) % len(SPLITS)]


def doc_split_topics(split: str) -> list[str]:
    split = canonical_split(split)
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


def is_whole_number(value, least: int = 0) -> bool:
    """``value`` is an integer (Python's or NumPy's, not a bool) of at least ``least``."""
    return not isinstance(value, bool) and isinstance(value, numbers.Integral) and value >= least


def _check_sample_count(n, where: str, allow_all: bool) -> None:
    """A count of samples must be a whole number of at least 0 (``None``: all, where allowed):
    -1 would slice from the end of the split and 2.5 fail deep in the slicing."""
    if n is None and allow_all:
        return
    if not is_whole_number(n):
        raise TaskError(f"{where}: {n!r} samples asked; the count must be a whole number of at least 0"
                        + (" (or None: all)" if allow_all else ""))


def default_task_samples(tokenizer, split: str = "test", n: int = 16,
                         history_tokens: int = DEFAULT_HISTORY_TOKENS, eval_tokens: int = DEFAULT_EVAL_TOKENS,
                         cue_tokens: int = 8, option_tokens: int = 6, n_options: int = 4,
                         seed: int = 0) -> list[Sample]:
    """Samples of the built-in documentation task (see module docstring).

    ``history_tokens`` counts the whole history (header + document window). Windows of a
    topic do not overlap; samples go round-robin over the split's topics.
    """
    split = canonical_split(split)
    _check_sample_count(n, f"the built-in task's {split} split", allow_all=False)
    header = _encode(tokenizer, HEADER)
    question = _encode(tokenizer, QUESTION)
    doc_len = history_tokens - len(header)
    if doc_len < 4 * (cue_tokens + option_tokens):
        raise TaskError(f"--history-tokens {history_tokens} is too short for the built-in task: its header alone is "
                        f"{len(header)} tokens and the document window needs at least "
                        f"{4 * (cue_tokens + option_tokens)} more")
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
        raise TaskError(f"the built-in task's {split} split has only {len(order)} windows of {need} tokens (a "
                        f"{doc_len}-token document window of the {history_tokens}-token history + {eval_tokens} "
                        f"evaluated tokens), {n} samples asked; ask for fewer samples, a shorter history "
                        "(--history-tokens) or fewer evaluated tokens (--eval-tokens)")
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
            history_labels=[TEXT] * (len(header) + len(doc)),
            eval_ids=ids[doc_len:doc_len + eval_tokens],
            question_ids=q_ids, options=options, answer=answer,
            meta={"id": sid, "topic": topic, "offset": offset, "split": split, "task": "default"},
        ))
    return samples


# ----------------------------------------------------------------------------- user JSONL task
RECORD_FIELDS = ("history", "images", "video", "question", "choices", "answer", "id")
MAX_TASK_BYTES = 1 << 30  # a task file is read whole; refuse anything larger than 1 GiB


def _record_error(path, line: int, problem: str, value=None) -> TaskError:
    shown = "" if value is None else f" (got {_short_repr(value)})"
    return TaskError(f"{path}:{line}: {problem}{shown}")


def _short_repr(v, limit: int = 60) -> str:
    r = repr(v)
    return r if len(r) <= limit else r[:limit - 3] + "..."


def _check_record(rec, path, line: int) -> None:
    if not isinstance(rec, dict):
        raise _record_error(path, line, "a task record must be a JSON object", type(rec).__name__)
    unknown = sorted(set(rec) - set(RECORD_FIELDS))
    if unknown:
        raise _record_error(path, line, f"unknown fields {unknown}; a record has {list(RECORD_FIELDS)}")
    for field in RECORD_FIELDS:  # JSON's \ud800 escapes decode to lone surrogates, which no tokenizer takes
        texts = rec.get(field) if isinstance(rec.get(field), list) else [rec.get(field)]
        for text in texts:
            if isinstance(text, str) and not _is_unicode_text(text):
                raise _record_error(path, line, f"field {field!r} is not valid Unicode text (it holds a lone "
                                    "surrogate, an unpaired \\ud800-\\udfff escape)")
    for key in ("history", "question"):
        if key not in rec:
            raise _record_error(path, line, f"missing field {key!r}")
        if not isinstance(rec[key], str) or not rec[key].strip():
            raise _record_error(path, line, f"field {key!r} must be a non-empty string", rec[key])
    images = rec.get("images")
    if images is not None and (not isinstance(images, list) or not all(isinstance(x, str) and x for x in images)):
        raise _record_error(path, line, "field 'images' must be a list of image file paths", images)
    video = rec.get("video")
    if video is not None and (not isinstance(video, list) or not video
                              or not all(isinstance(x, str) and x for x in video)):
        raise _record_error(path, line, "field 'video' must be a non-empty list of frame image paths", video)
    base = os.path.dirname(os.path.abspath(path))
    for field in ("images", "video"):
        for media in rec.get(field) or ():
            full = _media_path(media, base)
            if not os.path.isfile(full):
                raise _record_error(path, line, f"field {field!r}: {'image' if field == 'images' else 'frame'} "
                                    f"file not found: {full}")
    choices = rec.get("choices")
    if choices is not None and (not isinstance(choices, list) or len(choices) < 2
                                or not all(isinstance(c, str) and c for c in choices)):
        raise _record_error(path, line, "field 'choices' must be a list of at least 2 non-empty strings", choices)
    if "answer" in rec:
        a = rec["answer"]
        if isinstance(a, bool) or not isinstance(a, (str, int)):
            raise _record_error(path, line, "field 'answer' must be a string or a choice index", a)
        if choices:
            if isinstance(a, int) and not 0 <= a < len(choices):
                raise _record_error(path, line, f"answer index out of range for {len(choices)} choices", a)
            if isinstance(a, str) and a not in choices:
                raise _record_error(path, line, "answer is not one of the choices", a)
    if "id" in rec and not isinstance(rec["id"], (str, int)):
        raise _record_error(path, line, "field 'id' must be a string or an integer", rec["id"])


def _is_unicode_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# what makes two records the same record: a split keyed by it keeps copies together, and a copy is refused
_CONTENT_FIELDS = ("history", "images", "video", "question", "choices", "answer")


def _content_key(rec: Mapping[str, Any]) -> str:
    """A digest of a record's content (:data:`_CONTENT_FIELDS`), independent of its file, line and id."""
    content = json.dumps({k: rec.get(k) for k in _CONTENT_FIELDS}, sort_keys=True, ensure_ascii=True)
    return hashlib.sha256(content.encode()).hexdigest()


def task_file_digest(task: str | os.PathLike) -> str | None:
    """``sha256:<hex>`` of a JSONL task file's bytes (what a plan's search record names its task by, so that
    ``kvplan eval`` finds the same data under another path); ``None`` for the built-in task or an
    unreadable file."""
    from ..models.loading import file_sha256

    if os.fspath(task) == "default":
        return None
    try:
        return "sha256:" + file_sha256(task).hexdigest()
    except OSError:
        return None


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Records of a JSONL task file, checked (raises :class:`TaskError` naming file:line and field)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        if not os.path.exists(path):
            raise TaskError(f"{path}: task file not found")
        kind = "not a directory" if os.path.isdir(path) else "not a regular file (a pipe or a device?)"
        raise TaskError(f"{path}: task must be a JSONL file, {kind}")
    size = os.path.getsize(path)
    if size > MAX_TASK_BYTES:
        raise TaskError(f"{path}: task file is {size} bytes; at most {MAX_TASK_BYTES} are read")
    rows, ids, contents = [], {}, {}
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise TaskError(f"{path}: cannot read the task file ({e.strerror})") from None
    try:
        text = raw.decode("utf-8-sig")  # a byte-order mark (Windows editors write one) is not part of the JSON
    except UnicodeDecodeError as e:
        skipped = 3 if raw.startswith(b"\xef\xbb\xbf") else 0
        line = raw[:e.start + skipped].count(b"\n") + 1
        raise TaskError(f"{path}:{line}: not UTF-8 text ({e.reason} at byte {e.start + skipped} of the file)") from None
    for i, line in enumerate(text.replace("\r\n", "\n").replace("\r", "\n").split("\n"), 1):
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except RecursionError:
            raise _record_error(path, i, "not valid JSON (nested too deeply)") from None
        except ValueError as e:  # JSONDecodeError, or an integer of more than 4300 digits
            why = e.msg if isinstance(e, json.JSONDecodeError) else str(e).split(";")[0]
            raise _record_error(path, i, f"not valid JSON ({why})") from None
        _check_record(rec, path, i)
        rec = dict(rec)
        key = _content_key(rec)
        if key in contents:  # its copies could land in two splits: tested on what the search calibrated on
            raise _record_error(path, i, f"the same record as line {contents[key]} (history, question, choices, "
                                "answer and media all equal): a copy could land in another split and measure a "
                                "plan on data it was searched on; remove it")
        contents[key] = i
        rec["_key"] = str(rec["id"]) if "id" in rec else "content:" + key  # what split_records hashes
        rec["id"] = str(rec.get("id", f"{os.path.basename(path)}:{i}"))
        if rec["id"] in ids:
            raise _record_error(path, i, f"duplicate id (also on line {ids[rec['id']]})", rec["id"])
        ids[rec["id"]] = i
        rec["_base"] = os.path.dirname(os.path.abspath(path))
        rec["_line"] = i
        rec["_path"] = os.fspath(path)
        rows.append(rec)
    if not rows:
        raise TaskError(f"{path}: the task file holds no records")
    return rows


def split_records(records: Sequence[dict[str, Any]], split: str, seed: int = 0) -> list[dict[str, Any]]:
    """The records of ``split``: records ordered by a hash of ``seed`` and the record (its ``id`` when the
    file gives one, else its content: not its file name or line, so a renamed or re-ordered file splits the
    same way), then the first half is calibration, the next quarter validation, the rest test (each
    non-empty from 3 records on)."""
    split = canonical_split(split)
    order = sorted(records, key=lambda r: _hash(f"kvplan-records:{seed}:{r.get('_key', r['id'])}"))
    n = len(order)
    n_val = max(1, n // 4) if n >= 3 else 0
    n_test = max(1, n // 4) if n >= 2 else 0
    n_cal = n - n_val - n_test
    bounds = {"calibration": (0, n_cal), "validation": (n_cal, n_cal + n_val), "test": (n_cal + n_val, n)}
    lo, hi = bounds[split]
    return order[lo:hi]


def _tokenizer_of(processor):
    return getattr(processor, "tokenizer", processor)


def _media_path(path: str, base: str) -> str:
    """An image or frame path of a record: relative ones are the task file's folder's (``base``)."""
    return path if os.path.isabs(path) else os.path.join(base, path)


def _where(rec: dict[str, Any], field: str) -> str:
    """``<task file>:<line>: field '<field>'``: where a record's error is, as the checks before loading say."""
    return f"{rec.get('_path', 'task')}:{rec.get('_line', '?')}: field '{field}'"


def _load_image(path: str, rec: dict[str, Any], field: str = "images"):
    from PIL import Image, UnidentifiedImageError

    full = _media_path(path, rec.get("_base", "."))
    where = _where(rec, field)
    try:
        return Image.open(full).convert("RGB")
    except FileNotFoundError:
        raise TaskError(f"{where}: image file not found: {full}") from None
    except (UnidentifiedImageError, OSError) as e:
        raise TaskError(f"{where}: cannot read image {full} ({e})") from None


def _vision_brackets(config, processor) -> tuple[str, str]:
    """The tokens the model's chat template writes around each image or clip placeholder
    (``<|vision_start|>`` / ``<|vision_end|>`` of the Qwen-VL family, named by its config), or
    ``("", "")`` where the processor writes them itself (Gemma 3's begin/end of image) or there are none."""
    ids = [getattr(config, name, None) for name in ("vision_start_token_id", "vision_end_token_id")]
    if None in ids:
        return "", ""
    start, end = _tokenizer_of(processor).convert_ids_to_tokens(ids)
    return (start, end) if start and end else ("", "")


def _media_prompt(rec: dict[str, Any], processor, images: list, frames: list, config) -> tuple[str, dict[str, Any]]:
    """The processor's text (one placeholder per image, then one for the clip, each between the model's
    vision brackets as its chat template writes them and on its own line, so that they are separate
    runs of visual tokens, then the history) and media inputs."""
    import numpy as np

    start, end = _vision_brackets(config, processor)
    text, media = "", {}
    for kind, items, token_attr in (("images", images, "image_token"), ("video", frames, "video_token")):
        if not items:
            continue
        token = getattr(processor, token_attr, None)
        if token is None:
            raise TaskError(f"{_where(rec, kind)}: the model's processor has no {token_attr.replace('_', ' ')} "
                            "(is this a vision-language model?)")
        token = start + token + end
        if kind == "images":
            text += "".join(token + "\n" for _ in items)
            media["images"] = items
        else:
            sizes = sorted({f.size for f in items})
            if len(sizes) > 1:
                raise TaskError(f"{_where(rec, 'video')}: the clip's frames must share one size, got {sizes}")
            text += token + "\n"
            media["videos"] = [np.stack([np.asarray(f) for f in items])]  # one clip [T, H, W, 3]
    return text + rec["history"], media


def encode_user_record(rec: dict[str, Any], model, processor, labelling: Labelling | None = None) -> Sample:
    """One JSONL record -> :class:`Sample`. Images, then the video clip, come before the history text; every
    history token is labelled as the runtime labels it (image/video tokens ``visual``)."""
    tok = _tokenizer_of(processor)
    images = [_load_image(p, rec) for p in rec.get("images") or []]
    frames = [_load_image(p, rec, "video") for p in rec.get("video") or []]
    if images or frames:
        text, media = _media_prompt(rec, processor, images, frames, model.config)
        enc = processor(text=[text], return_tensors="pt", **media)
        ids = enc["input_ids"][0].tolist()
        extra = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
    else:
        ids = _encode(tok, rec["history"])
        extra = {}
    labels = resolve_labelling(labelling)(torch.tensor([ids]), model.config)[0]
    q_ids = _encode(tok, "\n" + rec["question"])
    choices = rec.get("choices")
    answer = rec.get("answer")
    options = ans_idx = None
    if choices:
        options = [_encode(tok, " " + str(c)) for c in choices]
        if answer is not None:
            ans_idx = answer if isinstance(answer, int) else list(choices).index(answer)
        eval_ids = q_ids
    else:
        eval_ids = q_ids + (_encode(tok, " " + str(answer)) if answer is not None else [])
    return Sample(ids, labels, eval_ids, question_ids=q_ids if options else None, options=options,
                  answer=ans_idx, prefill_inputs=extra, meta={"id": rec.get("id"), "task": "jsonl"})


def _records_of_split(path, records: Sequence[dict[str, Any]], split: str | None, seed: int,
                      n: int | None) -> list[dict[str, Any]]:
    """The first ``n`` (``None``: all) records of ``split`` (``None`` / ``"all"``: the whole task);
    :class:`TaskError` if the split is empty or holds fewer than ``n``."""
    whole = split is None or split == ALL_RECORDS
    where = "task" if whole else f"{canonical_split(split)} split"
    _check_sample_count(n, f"{os.fspath(path)}: the {where}", allow_all=True)
    recs = list(records) if whole else split_records(records, split, seed)
    if not recs:
        raise TaskError(f"{os.fspath(path)}: the {where} is empty: the task has only {len(records)} records (the "
                        "three splits need at least 3)")
    if n is not None and n > len(recs):
        raise TaskError(f"{os.fspath(path)}: {n} samples asked but the {where} has {len(recs)} of the task's "
                        f"{len(records)} records (calibration gets half, validation and test a quarter each)")
    return recs if n is None else recs[:n]


def user_task_samples(path: str | os.PathLike, model, processor, n: int | None = None, split: str | None = None,
                      seed: int = 0, labelling: Labelling | None = None) -> list[Sample]:
    """Samples of a JSONL task: all records (``split=None``) or those of one split, the first ``n``,
    labelled by ``labelling`` (default: token ids)."""
    recs = _records_of_split(path, read_jsonl(path), split, seed, n)
    return [encode_user_record(r, model, processor, labelling) for r in recs]


def check_task_lengths(task, history_tokens=None, eval_tokens=None) -> None:
    """Refuse a history or evaluated-token length given with a JSONL task (``None``: not given), whose records
    hold their own: such a length used to be ignored without a word."""
    if task == "default":
        return
    for name, value in (("history_tokens", history_tokens), ("eval_tokens", eval_tokens)):
        if value is not None:
            raise TaskError(f"{name}={value} (--{name.replace('_', '-')}): sets the built-in task's samples only; "
                            f"the records of the task file {task} hold their own history and evaluated tokens")


def check_task(task: str, samples: Mapping[str, int | None] | None = None, seed: int = 0) -> None:
    """Fail fast (before a model loads) on a task file that cannot be read or whose splits hold
    fewer records than ``samples`` (split -> number of samples asked; ``None``: all; 0: unused), or on a
    count that is not a whole number of at least 0, or a ``seed`` numpy cannot take."""
    check_seed(seed)
    if task == "default":
        for split, n in (samples or {}).items():
            if split == ALL_RECORDS and n != 0:
                raise TaskError(f"split {ALL_RECORDS!r} is for JSONL tasks; the built-in task has the calibration, "
                                "validation and test splits")
            _check_sample_count(n, f"the built-in task's {split} split", allow_all=False)
        return
    recs = read_jsonl(task)
    for split, n in (samples or {}).items():
        if n != 0:
            _records_of_split(task, recs, split, seed, n)


def task_samples(task: str, model, processor, split: str = "test", n: int | None = 16, seed: int = 0,
                 labelling: Labelling | None = None, **kwargs) -> list[Sample]:
    """Samples of ``task``: ``"default"`` or a path to a JSONL file (``kwargs``: options of the
    built-in task, e.g. ``history_tokens``). ``split="all"``: every record of a JSONL task;
    ``n=None``: every record of the split (JSONL tasks only). ``labelling``: how the history
    tokens are labelled, as deployment will label them (default: token ids)."""
    if task == "default":
        if split == ALL_RECORDS or n is None:
            raise TaskError("split 'all' and n=None are for JSONL tasks; the built-in task needs a split and a count")
        samples = default_task_samples(_tokenizer_of(processor), split=split, n=n, seed=seed, **kwargs)
        if labelling is None:
            return samples  # labelled text, as token ids label a text model's tokens
        lab = resolve_labelling(labelling)
        return [replace(s, history_labels=lab(torch.tensor([s.history_ids]), model.config)[0]) for s in samples]
    return user_task_samples(task, model, processor, n=n, split=None if split == ALL_RECORDS else split, seed=seed,
                             labelling=labelling)


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
