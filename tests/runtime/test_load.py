"""kvplan.load on the models and generate calls users bring: dtypes, attention features kvplan's
kernels lack, unload on VLMs, generation configs, copies of a loaded model."""

import copy
import warnings

import pytest
import torch

import kvplan
from kvplan.errors import KVPlanError, PlanError
from kvplan.plans import Reference
from tests.tiny_models import tiny_gemma3_vl, tiny_llama, tiny_llava_onevision


def _ids(n=300, seed=0):
    return torch.randint(3, 250, (1, n), generator=torch.Generator().manual_seed(seed))


def _generate_bpv(model, plan, n=300):
    ids = _ids(n)
    kvplan.load(model, plan)
    try:
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False,
                             return_dict_in_generate=True)
    finally:
        kvplan.unload(model)
    return out.cache.bpv(), out.cache.get_seq_length()


def test_a_baseline_name_states_its_bpv_at_the_models_width():
    """``kvplan.load(model, "int4")`` on an fp32 model: the baseline's tokens held at full precision
    take 32 bits, so its stated bpv is the cache's (it used to be stated at 16 bits)."""
    model = tiny_llama(head_dim=32)
    bpv, T = _generate_bpv(model, "int4")
    kvplan.load(model, "int4")
    plan = model.kvplan_plan
    kvplan.unload(model)
    assert plan.reference.full_precision_bits == 32 and bpv == plan.bpv(context_len=T).total


def test_a_plan_stated_at_another_width_warns_with_the_bpv_it_will_hold():
    """A plan searched on an fp32 model, deployed in bf16: its residual tokens take 16 bits, so the
    cache holds another bpv than the stated one; said at load, with the number."""
    model = tiny_llama(head_dim=32).to(torch.bfloat16)
    plan = kvplan.uniform_plan(kvplan.Geometry.of(model), 4, 2,
                               reference=Reference(context_len=512, full_precision_bits=32))
    want = plan.bpv(full_precision_bits=16).total
    with pytest.warns(UserWarning, match=f"states its bpv at 32-bit .* caches 16-bit values: its cache holds "
                                         f"{want:.4f} bpv at 512 tokens, not the stated {plan.bpv().total:.4f}"):
        kvplan.load(model, plan)
    kvplan.unload(model)
    quiet = kvplan.uniform_plan(kvplan.Geometry.of(model), 4, 2, residual_length=0,
                                reference=Reference(context_len=512, full_precision_bits=32))
    with warnings.catch_warnings():  # nothing held at full precision: the same bytes at either width
        warnings.simplefilter("error")
        kvplan.load(model, quiet)
    kvplan.unload(model)


def test_a_float64_model_is_refused_in_one_line():
    model = tiny_llama(head_dim=32).to(torch.float64)
    with pytest.raises(KVPlanError, match="model dtype float64: kvplan caches float32, float16 or bfloat16"):
        kvplan.load(model, "int4")


def _gemma2_softcapped():
    import transformers

    cfg = transformers.Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4096,
                                    max_position_embeddings=4096, query_pre_attn_scalar=16, attn_logit_softcapping=1.0,
                                    final_logit_softcapping=None, attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def _gpt_oss_with_sinks():
    import transformers

    cfg = transformers.GptOssConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2,
                                    num_experts_per_tok=1, sliding_window=4096, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 2.0)
    return model


@pytest.mark.parametrize("build,feature", [(_gemma2_softcapped, "caps its attention logits"),
                                           (_gpt_oss_with_sinks, "has learned attention sinks")])
def test_attention_kvplans_kernels_lack_is_refused_and_dequantize_is_exact(build, feature):
    """Logit soft-capping (Gemma 2) and learned sinks (GPT-OSS) are not in kvplan's kernels: the
    routes through them are refused at load (generate used to crash, or drop the sinks silently);
    the dequantize route runs the model's own attention: a 16-bit plan gives its logits exactly."""
    model = build()
    ids = _ids(40)
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
              return_dict_in_generate=True, output_logits=True)
    reference = torch.stack(model.generate(**kw).logits)
    with pytest.raises(PlanError, match=f"this model {feature}.*use attention='dequantize'"):
        kvplan.load(model, "fp16")
    kvplan.load(model, "fp16", attention="dequantize")
    try:
        assert torch.equal(torch.stack(model.generate(**kw).logits), reference)
    finally:
        kvplan.unload(model)


@pytest.mark.parametrize("build", [tiny_gemma3_vl, tiny_llava_onevision])
def test_unload_restores_a_vlms_text_attention(build):
    """The text decoder's own attention comes back after unload (the top-level config's used to)."""
    model = build()
    model.set_attn_implementation({"text_config": "eager", "vision_config": "sdpa"})
    kvplan.load(model, "int4")
    assert model.config.get_text_config(decoder=True)._attn_implementation != "eager"
    kvplan.unload(model)
    assert model.config.get_text_config(decoder=True)._attn_implementation == "eager"
    assert model.config.vision_config._attn_implementation == "sdpa"


def test_generation_config_without_cache_makes_no_cache():
    """``generation_config.use_cache = False`` is honoured as the keyword is: no kvplan cache."""
    model = tiny_llama(head_dim=32)
    ids = _ids(40)
    kvplan.load(model, "int2")
    try:
        model.generation_config.use_cache = False
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False,
                             return_dict_in_generate=True)
        assert getattr(out, "cache", None) is None and getattr(out, "past_key_values", None) is None
        model.generation_config.use_cache = True
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False,
                             return_dict_in_generate=True)
        assert isinstance(out.cache, kvplan.KVPlanCache)
    finally:
        kvplan.unload(model)


def test_a_deep_copy_of_a_loaded_model_generates_with_the_copy():
    """``copy.deepcopy(model)`` under kvplan.load: the copy's generate runs the copy (its own weights),
    on a cache of its own plan; unloading one leaves the other loaded."""
    model = tiny_llama(head_dim=32)
    kvplan.load(model, "int4")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.lm_head.weight.zero_()
    ids = _ids(40)
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False,
              return_dict_in_generate=True, output_logits=True)
    out = twin.generate(**kw)
    assert isinstance(out.cache, kvplan.KVPlanCache) and torch.stack(out.logits).abs().max() == 0
    assert torch.stack(model.generate(**kw).logits).abs().max() > 0
    kvplan.unload(twin)
    assert "generate" not in vars(twin) and "generate" in vars(model)
    kvplan.unload(model)
