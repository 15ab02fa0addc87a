"""The bpv a user gets: load a plan with kvplan.load on the default model, generate on plain-text
prompts of the plan's reference length and of other lengths, print the bits per value the cache
really holds next to ``plan.bpv(context_len=T)``.

Usage (repo root, venv active)::

    python bench/deployed_bpv.py bench/results/search-2.5bpv.yaml
"""
import sys, torch
torch.set_num_threads(1)
import kvplan
from pydoc_data.topics import topics

from _stamp import stamp

print(f"Command: {stamp()}", flush=True)

plan_path = sys.argv[1]
plan = kvplan.Plan.from_yaml(plan_path)
model, tok = kvplan.load_model()
kvplan.load(model, plan_path)
ids = tok(topics["specialnames"] + topics["if"], return_tensors="pt").input_ids  # text outside the task's windows
print(f"plan {plan_path}: target {plan.target_bpv}, stated {plan.bpv().total:.4f} at {plan.reference.context_len} tokens")
for T in (plan.reference.context_len, 300, 1000, 2048):
    x = ids[:, :T]
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=1, do_sample=False,
                         return_dict_in_generate=True)
    c = out.cache
    print(f"prompt {T} tokens: cache holds {c.get_seq_length()} tokens, {c.bpv():.4f} bpv measured, "
          f"plan.bpv(context_len) {plan.bpv(context_len=c.get_seq_length()).total:.4f}")
kvplan.unload(model)
