"""A small end-to-end demonstration: generate on a plan, compare memory with the full-precision cache."""

from __future__ import annotations

import os
import time


def default_prompt() -> str:
    """A long-ish real prompt (~800 tokens) so that most of the cache gets quantized."""
    from pydoc_data.topics import topics

    return ("Here is a section of the Python documentation.\n\n" + topics["with"].strip()
            + "\n\nIn one sentence, what does the with statement do?")


def generate_demo(plan="int4", model="smollm2-135m", prompt=None, max_new_tokens=48) -> dict:
    """Generate with ``plan`` on ``model``; print the text and the cache bytes next to the
    full-precision cache this model holds without kvplan (``DynamicCache`` in the model's dtype:
    float32 on CPU by default) and next to an fp16 cache."""
    from ..models import load_model
    from ..plans import Plan
    from ..plans.baselines import check_plan_argument
    from .load import load, unload

    prompt = default_prompt() if prompt is None else prompt
    if isinstance(plan, (str, os.PathLike)) and not check_plan_argument(os.fspath(plan)):
        Plan.from_yaml(os.fspath(plan))  # a file that does not parse fails before the model loads (load names it)
    t0 = time.perf_counter()
    m, tok = load_model(model) if isinstance(model, str) else model
    if hasattr(tok, "apply_chat_template") and getattr(tok, "chat_template", None):
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True)
    else:
        text = prompt
    inputs = tok(text=text, return_tensors="pt")  # by keyword: a VLM's processor takes images first
    load(m, plan)
    try:
        out = m.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True)
    finally:
        unload(m)
    cache = out.cache
    n_prompt = inputs["input_ids"].shape[1]
    reply = tok.decode(out.sequences[0, n_prompt:], skip_special_tokens=True)
    parts = cache.nbytes_breakdown()
    dtype = next(m.parameters()).dtype
    elem = dtype.itemsize
    native_bytes = cache.num_values() * elem
    fp16_bytes = cache.num_values() * 2
    print(f"plan: {cache.plan.name or plan}  model: {model if isinstance(model, str) else type(m).__name__}")
    print(f"prompt tokens: {n_prompt}, generated: {out.sequences.shape[1] - n_prompt}, "
          f"cached tokens: {cache.get_seq_length()}")
    print(f"reply: {reply.strip()}")
    print(f"kvplan cache: {parts['total']:,} bytes (codes {parts['payload']:,}, scales/zeros "
          f"{parts['scales_zeros']:,}, key correction {parts['correction']:,}, per-token residual "
          f"{parts['residual']:,}: newest tokens, recent, heavy-hitter and streamed-head copies) = "
          f"{cache.bpv():.3f} bits/value")
    print(f"without kvplan this model caches {str(dtype).removeprefix('torch.')}: {native_bytes:,} bytes = "
          f"{8 * elem:.3f} bits/value  ->  kvplan uses {parts['total'] / native_bytes:.1%} of it")
    if elem != 2:
        print(f"an fp16 cache (the same model in fp16, e.g. on a GPU): {fp16_bytes:,} bytes  ->  kvplan uses "
              f"{parts['total'] / fp16_bytes:.1%} of it")
    print(f"({time.perf_counter() - t0:.1f} s)")
    return {"reply": reply, "bytes": parts, "native_bytes": native_bytes, "native_dtype": str(dtype),
            "fp16_bytes": fp16_bytes, "bpv": cache.bpv()}
