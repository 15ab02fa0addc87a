"""kvplan.load on the models and generate calls users bring: dtypes, attention features kvplan's
kernels lack, unload on VLMs, generation configs, copies of a loaded model."""

import copy
import dataclasses
import warnings

import pytest
import torch

import kvplan
from kvplan.errors import KVPlanError, PlanError
from kvplan.plans import Reference, at_model_width
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


def test_a_model_cast_after_load_is_warned_about_once_with_the_bpv_its_cache_holds():
    """``model.to(torch.bfloat16)`` after ``kvplan.load``: the plan's full-precision tokens now take 16
    bits, so the next ``generate`` says what its cache holds (the load-time check saw 32 bits), once."""
    model = tiny_llama(head_dim=32)
    plan = kvplan.uniform_plan(kvplan.Geometry.of(model), 4, 2,
                               reference=Reference(context_len=300, full_precision_bits=32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kvplan.load(model, plan)  # fp32 model, plan stated at 32 bits: nothing to say
    model.to(torch.bfloat16)
    ids = _ids(300)
    want = plan.bpv(full_precision_bits=16).total
    try:
        with pytest.warns(UserWarning, match=f"states its bpv at 32-bit .* caches 16-bit values: its cache holds "
                                             f"{want:.4f} bpv at 300 tokens"):
            out = model.generate(input_ids=ids, max_new_tokens=1, do_sample=False, return_dict_in_generate=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once, not at every generate
            model.generate(input_ids=ids, max_new_tokens=1, do_sample=False)
    finally:
        kvplan.unload(model)
    assert out.cache.get_seq_length() == 300 and out.cache.bpv() == pytest.approx(want, rel=1e-12)


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


# ----------------------------------------------------------------------------- generate options
def _loaded_llama(plan=None, attention="auto"):
    model = tiny_llama(head_dim=32)
    plan = plan if plan is not None else kvplan.uniform_plan(kvplan.Geometry.of(model), 4, 2, residual_length=8,
                                                             **at_model_width(model))
    kvplan.load(model, plan, attention=attention)
    return model


def test_a_generation_config_that_leaves_use_cache_unset_still_runs_on_the_plans_cache():
    """transformers 5 leaves ``GenerationConfig().use_cache`` None (on); it used to be read as off, so generate
    built its own unquantized cache -- from a generation_config passed, or a checkpoint's own."""
    from transformers import GenerationConfig

    model = _loaded_llama()
    ids = _ids(40)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=GenerationConfig(
        max_new_tokens=3, do_sample=False, return_dict_in_generate=True))
    assert isinstance(out.cache, kvplan.KVPlanCache)
    model.generation_config.use_cache = None  # as a checkpoint whose generation_config.json omits it
    out = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    assert isinstance(out.cache, kvplan.KVPlanCache)
    assert model.generate(input_ids=ids, max_new_tokens=3, use_cache=False, return_dict_in_generate=True).cache is None


def test_a_left_padded_batch_without_a_mask_is_aligned_as_generate_infers_its_mask():
    """generate infers the mask from pad_token_id when none is passed; the cache used to be left unaligned,
    so a padded row was stored (and decoded) unlike the same prompt alone."""
    model = tiny_llama(head_dim=32)
    base = kvplan.uniform_plan(kvplan.Geometry.of(model), 2, 2, residual_length=8, **at_model_width(model))
    kvplan.load(model, base.replace(quantizer=dataclasses.replace(base.quantizer, sink_length=1)))
    alone = _ids(33, seed=2)
    batch = torch.zeros(2, 45, dtype=torch.long)  # pad_token_id 0 on the left of row 1
    batch[0], batch[1, 12:] = _ids(45, seed=1)[0], alone[0]
    kw = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_logits=True)
    want = model.generate(input_ids=alone, attention_mask=torch.ones_like(alone), **kw)
    got = model.generate(input_ids=batch, **kw)
    assert got.cache.row_padding == [0, 12]
    assert torch.allclose(torch.stack(got.logits, 1)[1], torch.stack(want.logits, 1)[0], atol=1e-5)


@pytest.mark.parametrize("keyword", ["cache", "past_key_values"])
def test_a_cache_of_another_kind_passed_to_generate_is_refused(keyword):
    """A DynamicCache passed in used to be filled at full precision, silently."""
    from transformers import DynamicCache

    model = _loaded_llama()
    with pytest.raises(KVPlanError, match=f"generate got a DynamicCache as {keyword}=.*kvplan.make_cache") as e:
        model.generate(input_ids=_ids(20), max_new_tokens=2, **{keyword: DynamicCache()})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("attention", ["auto", "dequantize"])
@pytest.mark.parametrize("implementation", ["static", "paged", "offloaded"])
def test_generate_refuses_a_cache_implementation_that_would_replace_the_plans_cache(attention, implementation):
    """``cache_implementation="paged"`` on the dequantize route used to switch to continuous batching and
    generate on an unquantized cache; the others met transformers' 'Passing both ... and `cache`'."""
    model = _loaded_llama(attention=attention)
    ids = _ids(20)
    with pytest.raises(KVPlanError, match=f"cache_implementation='{implementation}' \\(from cache_implementation=\\)"):
        model.generate(input_ids=ids, max_new_tokens=2, cache_implementation=implementation)
    model.generation_config.cache_implementation = implementation
    with pytest.raises(KVPlanError, match="from model.generation_config"):
        model.generate(input_ids=ids, max_new_tokens=2)
    model.generation_config.cache_implementation = "hybrid"  # transformers drops it for a Cache passed in
    assert isinstance(model.generate(input_ids=ids, max_new_tokens=2, return_dict_in_generate=True).cache,
                      kvplan.KVPlanCache)


def test_output_attentions_is_refused_where_kvplans_attention_runs_and_kept_on_the_dequantize_route():
    """kvplan's attention function returns no weights: an eager model's attentions used to come back empty."""
    ids = _ids(40)
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False,
              return_dict_in_generate=True, output_attentions=True)
    model = tiny_llama(head_dim=32)
    model.set_attn_implementation("eager")
    kvplan.load(model, "int4")
    with pytest.raises(KVPlanError, match=r"output_attentions=True \(from output_attentions=\).*'dequantize'"):
        model.generate(**kw)
    kvplan.load(model, "int4", attention="dequantize")
    out = model.generate(**kw)
    assert out.attentions[0][0].shape == (1, 4, 40, 40) and isinstance(out.cache, kvplan.KVPlanCache)


@pytest.mark.parametrize("then", ["unload", "dequantize"])
def test_a_conversations_cache_refuses_to_be_read_by_another_attention_than_it_was_made_for(then):
    """A cache made under kvplan's fused kernel hands its attention only the dense tail: continued after
    kvplan.unload (or a load on the dequantize route), the model's own attention silently skipped the
    quantized history (0.74 max logit difference), or failed deep inside transformers on a new turn."""
    model = tiny_llama()
    ids = _ids(100)
    plan = kvplan.uniform_plan(kvplan.Geometry.of(model), 8, residual_length=0)
    kvplan.load(model, plan)
    out = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    if then == "unload":
        kvplan.unload(model)
    else:
        kvplan.load(model, plan, attention="dequantize")
    n = out.cache.get_seq_length()
    for extra in ([], [5, 6, 7]):  # the reply continued, and a new turn
        seq = torch.cat([out.sequences, torch.tensor([extra], dtype=torch.long)], 1) if extra else out.sequences
        with pytest.raises(KVPlanError, match="made to be read by kvplan's attention .*now attends with 'sdpa'"):
            model.generate(input_ids=seq, past_key_values=out.cache, max_new_tokens=2, do_sample=False)
        assert out.cache.get_seq_length() == n  # refused before anything was written
    kvplan.load(model, plan)  # under the load it was made under, the conversation goes on
    more = model.generate(input_ids=out.sequences, past_key_values=out.cache, max_new_tokens=2, do_sample=False)
    assert more.shape[1] == out.sequences.shape[1] + 2
    kvplan.unload(model)


def test_a_model_that_cannot_switch_its_attention_is_refused_at_load_not_at_generate():
    """Bloom keeps its attention implementation (transformers only logs that it cannot switch it): kvplan.load
    on the kernel route returned normally, and the first generate failed with a CacheError saying the model
    had been unloaded or reloaded since the cache was made."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(transformers.BloomConfig(
        vocab_size=256, hidden_size=64, n_layer=2, n_head=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)).eval()
    ids = torch.randint(3, 250, (1, 40), generator=torch.Generator().manual_seed(0))
    plain = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
    with pytest.raises(kvplan.PlanError, match="attention: BloomForCausalLM cannot switch its attention implementation "
                                               r"\(it keeps 'eager'\).*use attention='dequantize'"):
        kvplan.load(model, "int4")
    assert getattr(model, "kvplan_plan", None) is None and "_kvplan_previous_attention" not in model.__dict__
    assert torch.equal(model.generate(input_ids=ids, max_new_tokens=3, do_sample=False), plain)
    kvplan.load(model, "int4", attention="dequantize")
    try:
        assert model.generate(input_ids=ids, max_new_tokens=3, do_sample=False).shape == plain.shape
    finally:
        kvplan.unload(model)
