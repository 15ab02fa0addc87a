"""quantizer.heavy_length: each KV head keeps residual-precision copies of its most-attended committed
tokens, chosen by a prompt's last queries; reads of quantized slots use them."""

import pytest
import torch

import kvplan
from kvplan import Geometry, KVPlanCache, uniform_plan
from kvplan.evaluation.harness import Sample, build_plan_cache, prepare_sample
from kvplan.kernels import reference
from kvplan.runtime.heavy import HEAVY_WINDOW, window_mass
from kvplan.runtime.load import attention_route, make_cache
from tests.runtime.routes import KERNELS, generate_like_dequantize, prefill_then_decode, random_kv, with_quantizer
from tests.tiny_models import gemma3_vl_inputs, tiny_gemma3_vl, tiny_llama

GEOM = Geometry(2, 2, 16, ("full", "full"), "llama")
HYBRID = Geometry(2, 2, 64, ("full", "sliding"), "llama", 48)


def _resolve_waiting(cache):
    """Resolve tokens committed by writes without an attention call, unscored (what the next write does)."""
    for layer in cache.layers:
        if layer.heavy is not None:
            layer.heavy.resolve()


@pytest.mark.parametrize("bits", [16, 8])
def test_bytes_equal_the_plan_at_every_length(bits):
    """Prefill then token by token on a full and a sliding-window layer, with a sink, a residual window
    and recent copies: the cache holds exactly plan.bpv(T) (fp32 storage) after every step, the full
    layer min(5, committed - sink) copies per head, the sliding layer none."""
    plan = with_quantizer(uniform_plan(HYBRID, 2, group_size=32, residual_length=8, sink_length=1),
                          residual_bits=bits, recent_length=3, heavy_length=5)
    without = with_quantizer(plan, heavy_length=0)
    cache = KVPlanCache(plan, HYBRID)
    for T in prefill_then_decode(cache, 70):
        _resolve_waiting(cache)
        assert cache.bpv() == plan.bpv(context_len=T, full_precision_bits=32).total, (bits, T)
        full = cache.layers[0]
        assert full.heavy.length == (min(5, full.committed - 1) if full.committed else 0), T
        assert cache.layers[1].heavy is None
    # 5 copies x 2 heads x (K and V codes + position and score)
    token = plan.quantizer.residual_token_bytes(64, 4)
    extra = (plan.bpv(context_len=T, full_precision_bits=32).total
             - without.bpv(context_len=T, full_precision_bits=32).total)
    n_values = 2 * 2 * 64 * (T + T - cache.layers[1].dropped)
    assert extra == pytest.approx(8 * 5 * 2 * (2 * token + 8) / n_values)


def test_the_most_attended_tokens_are_kept_and_read_from_their_copies():
    """A window query that points at token 10 (head 0) and 40 (head 1) keeps them; unscored tokens
    fill the other places newest first; the kept tokens read as their 8-bit per-token codes, every
    other committed token as its slot codes (those of the plan without copies)."""
    base = with_quantizer(uniform_plan(GEOM, 2, group_size=32, residual_length=0, sink_length=1), residual_bits=8)
    plan = with_quantizer(base, heavy_length=3)
    k, v = random_kv(64, 1)
    layer = KVPlanCache(plan, GEOM).layers[0]
    plain = KVPlanCache(base, GEOM).layers[0]
    keys, _ = layer.update(k, v)
    plain.update(k, v)
    assert layer.heavy.pending and layer.heavy.length == 0
    q = torch.zeros(1, 2, 4, 16)
    q[0, 0, -1] = 20 * k[0, 0, 10]
    q[0, 1, -1] = 20 * k[0, 1, 40]
    layer.observe_prompt(q, keys, 1.0)
    pos = layer.heavy.positions[0]
    assert pos[0, 0] == 10 and pos[1, 0] == 40 and not layer.heavy.pending
    c, s, z = reference.quantize(k, 8, 32, "token")
    coded = reference.dequantize(c, s, z, 8, 32, "token", 16, dtype=torch.float32)
    got, want = layer._read("k"), plain._read("k")
    for h in range(2):
        kept = pos[h].long()
        assert torch.equal(got[0, h, kept], coded[0, h, kept])
        others = torch.ones(64, dtype=torch.bool)
        others[kept] = False
        assert torch.equal(got[0, h, others], want[0, h, others])
    assert (got[0, 0, 10] - k[0, 0, 10]).abs().max() < (want[0, 0, 10] - k[0, 0, 10]).abs().max()


def test_unscored_tokens_never_displace_scored_copies():
    """Tokens committed by decode steps (no prompt scores them) fill free places only."""
    plan = with_quantizer(uniform_plan(GEOM, 2, group_size=32, residual_length=0, sink_length=1), residual_bits=8,
                          heavy_length=2)
    layer = KVPlanCache(plan, GEOM).layers[0]
    k, v = random_kv(32, 3)
    keys, _ = layer.update(k, v)
    q = torch.zeros(1, 2, 1, 16)
    q[0, :, 0] = 20 * k[0, :, 5]
    layer.observe_prompt(q, keys, 1.0)
    before = layer.heavy.positions.clone()
    for t in range(32):
        layer.update(*random_kv(1, 10 + t))
    layer.update(*random_kv(1, 99))  # resolves the tokens the 64th one committed
    assert layer.committed == 64 and torch.equal(layer.heavy.positions, before)


def test_window_mass_is_the_softmax_of_the_last_queries():
    """window_mass sums, over the last HEAVY_WINDOW queries and the query heads of each KV head, the
    causal softmax probabilities; a bool mask gives the same as the causal default."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 40, 8, generator=g), torch.randn(1, 2, 50, 8, generator=g)
    got = window_mass(q, k, 0.5)
    want = torch.zeros(1, 2, 50)
    for hq in range(4):
        for i in range(40 - HEAVY_WINDOW, 40):
            p = 50 - 40 + i  # the query's position among the keys
            s = (q[0, hq, i] @ k[0, hq // 2, : p + 1].T) * 0.5
            want[0, hq // 2, : p + 1] += torch.softmax(s, -1)
    torch.testing.assert_close(got, want)
    causal = torch.ones(40, 50, dtype=torch.bool).tril(diagonal=10)[None, None]
    torch.testing.assert_close(window_mass(q, k, 0.5, causal), want)
    assert got.sum().item() == pytest.approx(4 * HEAVY_WINDOW, rel=1e-5)


@pytest.mark.parametrize("attention", KERNELS)
def test_fused_kernels_read_the_copies_like_the_dequantize_route(attention):
    """Greedy generation on a tiny Llama with a sink, recent copies and Hadamard-rotated blocks: the
    prompt's attention chooses the copies, and the packed kernels (copies appended, their packed
    positions masked) give the dequantize route's tokens and scores across later commits."""
    model = tiny_llama()
    plan = with_quantizer(uniform_plan(Geometry.of(model), 2, group_size=32, residual_length=0, sink_length=1),
                          residual_bits=8, recent_length=3, heavy_length=4, rotation="hadamard")
    out, _ = generate_like_dequantize(model, plan, attention, max_new_tokens=40)
    without = with_quantizer(plan, heavy_length=0)
    kvplan.load(model, without, attention=attention)
    plain = model.generate(input_ids=out.sequences[:, :48], max_new_tokens=40, do_sample=False, output_scores=True,
                           return_dict_in_generate=True)
    kvplan.unload(model)
    assert any(not torch.equal(a, b) for a, b in zip(out.scores, plain.scores))  # the copies change what is read


@pytest.mark.parametrize("attention", KERNELS)
def test_decode_steps_fill_free_copies_unscored_on_every_route(attention):
    """More copies than the prompt commits: the tokens decode steps commit fill the free places unscored
    (score -1) on the dequantize route as on the packed kernels, so both keep the same copies and read
    the same numbers (the dequantize route once scored them by the step's one query)."""
    model = tiny_llama()
    plan = with_quantizer(uniform_plan(Geometry.of(model), 2, group_size=32, residual_length=0, sink_length=1),
                          residual_bits=8, recent_length=3, heavy_length=40, rotation="hadamard")
    out, ref = generate_like_dequantize(model, plan, attention, max_new_tokens=40)  # commits at 32 (prompt), 64
    for got, want in zip(out.cache.layers, ref.cache.layers):
        assert torch.equal(got.heavy.positions.sort(-1).values, want.heavy.positions.sort(-1).values)
        assert torch.equal(got.heavy.scores, want.heavy.scores)
        decoded = want.heavy.positions >= 32  # committed by the decode step that reached 64 tokens
        assert bool(decoded.any()) and bool((want.heavy.scores[decoded] == -1).all())
        assert bool((want.heavy.scores[~decoded] > 0).all())


@pytest.mark.parametrize("attention", ["dequantize", "native"])
def test_the_harness_keeps_the_copies_a_deployed_prompt_keeps(attention):
    """The search's harness (history written, then scored with the queries its full-precision prefill
    recorded) keeps the same copies, reads and bytes as a prompt run through kvplan.load."""
    model = tiny_llama()
    g = Geometry.of(model)
    plan = with_quantizer(uniform_plan(g, 2, group_size=32, residual_length=0, sink_length=1), residual_bits=8,
                          recent_length=3, heavy_length=4, rotation="hadamard")
    history = torch.randint(5, 200, (70,), generator=torch.Generator().manual_seed(0)).tolist()
    prepared = prepare_sample(model, Sample(history, ["text"] * 70, [7, 8, 9]), attention=attention)
    with attention_route(model, attention):
        harness = build_plan_cache(model, plan, prepared)
    kvplan.load(model, plan, attention=attention)
    deployed = make_cache(model, plan, torch.tensor([history]))
    with torch.no_grad():
        model(input_ids=torch.tensor([history]), cache=deployed, use_cache=True)
    kvplan.unload(model)
    for a, b in zip(harness.layers, deployed.layers):
        assert a.heavy.length == 4 and torch.equal(a.heavy.positions, b.heavy.positions)
        assert torch.equal(a._read("k"), b._read("k")) and torch.equal(a._read("v"), b._read("v"))
    assert harness.bpv() == deployed.bpv() == plan.bpv(context_len=70, full_precision_bits=32).total


def test_search_scores_heavy_hitters_with_a_vlms_own_prefill_mask():
    """Gemma 3's image tokens attend both ways in the prefill: with images among a prompt's last
    queries, the harness scores the heavy-hitter candidates with the forward's own mask (recorded with
    the queries), as kvplan's attention does at a deployed prompt: the same scores, bit for bit."""
    model = tiny_gemma3_vl(sliding_window=512)
    inputs = gemma3_vl_inputs(model, 3, before=tuple(range(3, 100)), after=tuple(range(20, 30)))
    ids = inputs["input_ids"]
    labels = kvplan.models.labels_from_input_ids(ids, model.config)[0]
    assert "visual" in labels[-HEAVY_WINDOW:]
    base = uniform_plan(Geometry.of(model), 4, modalities=("text", "visual"), group_size=32, residual_length=0)
    plan = with_quantizer(base, heavy_length=4)
    kvplan.load(model, plan, attention="dequantize")
    deployed = model.generate(**inputs, max_new_tokens=1, do_sample=False, return_dict_in_generate=True).cache
    kvplan.unload(model)
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    prepared = prepare_sample(model, Sample(ids[0].tolist(), labels, [5, 6], prefill_inputs=extra),
                              attention="dequantize")
    with attention_route(model, "dequantize", plan):
        searched = build_plan_cache(model, plan, prepared)
    scored = [(a.heavy, b.heavy) for a, b in zip(deployed.layers, searched.layers) if a.heavy is not None]
    assert scored
    for a, b in scored:
        assert torch.equal(a.scores, b.scores) and torch.equal(a.positions, b.positions)


def test_prefill_recording_changes_no_number():
    """prepare_sample records the prefill's last queries through the model's own attention: the
    history states are those of a plain forward, bit for bit."""
    model = tiny_llama()
    ids = torch.randint(5, 200, (1, 40), generator=torch.Generator().manual_seed(1))
    prepared = prepare_sample(model, Sample(ids[0].tolist(), ["text"] * 40, [7, 8]))
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    for i, (k, v) in enumerate(prepared.kv):
        assert torch.equal(k, cache.layers[i].keys) and torch.equal(v, cache.layers[i].values)
    q, scaling, _ = prepared.window_queries[0]
    assert q.shape == (1, model.config.num_attention_heads, min(HEAVY_WINDOW, 40), model.config.head_dim)
    assert scaling == model.config.head_dim ** -0.5
    assert model.config._attn_implementation != "kvplan_record_window"  # restored


@pytest.mark.parametrize("attention", KERNELS)
def test_left_padded_batch_copies_only_real_tokens(attention):
    """A left-padded batch through generate: the padded row's prompt attention gives its padding no
    mass, so no copy points at a padding position, and the packed kernels read what the dequantize
    route reads."""
    model = tiny_llama()
    plan = with_quantizer(uniform_plan(Geometry.of(model), 2, group_size=32, residual_length=0, sink_length=1),
                          residual_bits=8, recent_length=3, heavy_length=4, rotation="hadamard")
    ids = torch.randint(5, 200, (2, 60), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 60, dtype=torch.long)
    # padding with a token the row's prompt attends to: only the attention mask keeps it out of the copies
    mask[1, :17], ids[1, :17] = 0, ids[1, 28]
    runs = {}
    for route in ("dequantize", attention):
        kvplan.load(model, plan, attention=route)
        runs[route] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                                     output_scores=True, return_dict_in_generate=True)
        kvplan.unload(model)
    out, ref = runs[attention], runs["dequantize"]
    for run in (ref, out):
        for layer in run.cache.layers:
            assert layer.heavy.length == 4
            assert bool((layer.heavy.positions[1] >= 17).all()), layer.heavy.positions[1]
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
