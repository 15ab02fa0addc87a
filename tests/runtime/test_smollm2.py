"""The runtime on the real embedded SmolLM2-135M-Instruct."""

import pytest
import torch
from pydoc_data.topics import topics
from transformers import DynamicCache

import kvplan
from kvplan import KVPlanCache, baseline_plan

pytestmark = pytest.mark.slow


def _history_kl(model, tok, plan, history_tokens=400, eval_tokens=48):
    """Mean KL(P_fp || P_q) over eval tokens that read a quantized history."""
    text = topics["assignment"] + topics["for"]
    ids = tok(text, return_tensors="pt").input_ids[:, : history_tokens + eval_tokens]
    hist, ev = ids[:, :history_tokens], ids[:, history_tokens:]
    logps = []
    for cache in (DynamicCache(), KVPlanCache(plan, model)):
        model(input_ids=hist, cache=cache, use_cache=True)
        out = model(input_ids=ev, cache=cache, use_cache=True)
        logps.append(torch.log_softmax(out.logits.float(), -1))
    fp, q = logps
    return (fp.exp() * (fp - q)).sum(-1).mean().item()


def test_fp16_plan_generates_identically(smollm2):
    model, tok = smollm2
    msgs = [{"role": "user", "content": "Name three colours of the rainbow."}]
    inputs = tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), return_tensors="pt")
    ref = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    kvplan.load(model, "fp16")
    try:
        out = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    finally:
        kvplan.unload(model)
    assert torch.equal(out, ref)


def test_kl_ordering_int8_int4_int2(smollm2):
    model, tok = smollm2
    g = kvplan.Geometry.of(model)
    kl = {name: _history_kl(model, tok, baseline_plan(name, g, residual_length=0))
          for name in ("fp16", "int8", "int4", "int2")}
    assert kl["fp16"] == 0.0
    assert 0 < kl["int8"] < 1e-3
    assert kl["int8"] < kl["int4"] < kl["int2"]
    assert kl["int2"] > 3 * kl["int4"]


def test_generate_reports_memory(smollm2):
    model, tok = smollm2
    inputs = tok(topics["with"][:3000], return_tensors="pt")
    kvplan.load(model, "int4")
    try:
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    finally:
        kvplan.unload(model)
    cache = out.cache
    parts = cache.nbytes_breakdown()
    assert parts["payload"] > 0 and parts["scales_zeros"] > 0 and parts["residual"] > 0
    labels = ["text"] * cache.get_seq_length()
    predicted = cache.plan.bpv(context_len=len(labels), modality_mix=labels, full_precision_bits=32)
    assert cache.bpv() == predicted.total
