"""Gemma-3-270M: the bpv and bytes a user gets with a plan through kvplan.load, next to the model's
own DynamicCache (whose 15 sliding-window layers keep 511 tokens), at prompts shorter and longer
than the window (512).

Usage (repo root, venv active)::

    OMP_NUM_THREADS=1 python bench/gemma3_deployed.py bench/results/gemma3/plan.yaml
"""
import sys

import torch
from pydoc_data.topics import topics
from transformers import DynamicCache

import kvplan
from _stamp import stamp

print(f"Command: {stamp()}", flush=True)
torch.set_num_threads(1)
plan_path = sys.argv[1]
plan = kvplan.Plan.from_yaml(plan_path)
model, tok = kvplan.load_model("gemma3-270m")
kvplan.load(model, plan_path)
ids = tok(topics["specialnames"] + topics["if"] + topics["types"], return_tensors="pt").input_ids
print(f"plan {plan_path}: target {plan.target_bpv}, stated {plan.bpv().total:.4f} at {plan.reference.context_len} tokens")
for T in (plan.reference.context_len, 300, 1000, 2048):
    x = ids[:, :T]
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=1, do_sample=False,
                         return_dict_in_generate=True)
    c = out.cache
    fp = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=out.sequences[:, :-1], cache=fp)
    fp_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in fp.layers)
    print(f"prompt {T} tokens: cache holds {c.get_seq_length()} tokens, {c.bpv():.4f} bpv measured, "
          f"plan.bpv(context_len) {plan.bpv(context_len=c.get_seq_length()).total:.4f}; {c.nbytes():,} bytes vs "
          f"DynamicCache {fp_bytes:,} ({c.nbytes() / fp_bytes:.1%})")
kvplan.unload(model)
