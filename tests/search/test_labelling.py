"""A user's own token labelling, given to both the search and kvplan.load (issue 13): the plan
records its name, kvplan.load refuses the plan under another labelling, and with the same one
every stored token gets its label's bits."""

import json

import pytest
import torch

import kvplan
from kvplan.errors import PlanError
from kvplan.models.modality import Labelling, LabellingError


def _digits_of(tok):
    """Tokens of the SmolLM2 vocabulary whose text holds a digit."""
    return {i for t, i in tok.get_vocab().items() if any(c.isdigit() for c in t)}


def _numbers_labelling(tok):
    digits = _digits_of(tok)

    def numbers(input_ids, config):
        return [["number" if t in digits else "text" for t in row] for row in input_ids.tolist()]

    return Labelling(numbers, modalities=("text", "number"), name="tests.numbers")


def test_labelling_checks_what_the_function_returns():
    lab = Labelling(lambda ids, cfg: [["text"] * (ids.shape[1] - 1)], ("text",), name="short")
    with pytest.raises(LabellingError, match=r"returned 1 rows of lengths \[2\] for input_ids of shape \[1, 3\]"):
        lab(torch.zeros(1, 3, dtype=torch.long), None)
    lab = Labelling(lambda ids, cfg: [["text", "code", "text"]], ("text",), name="odd")
    with pytest.raises(LabellingError, match=r"label 'code' at row 0, token 1 is not one of its modalities"):
        lab(torch.zeros(1, 3, dtype=torch.long), None)
    with pytest.raises(LabellingError, match="including 'text'"):
        Labelling(lambda ids, cfg: [], ("code",))
    with pytest.raises(LabellingError, match="default labelling"):
        Labelling(lambda ids, cfg: [], ("text",), name="token-ids")


def test_a_lambda_or_nested_labelling_needs_a_name():
    """Every lambda was named ``module.<lambda>``: kvplan.load took a plan searched with one lambda under
    any other, and stored the prompt by another labelling than the search's, silently."""
    with pytest.raises(LabellingError, match="a lambda or a function defined inside another .*pass name="):
        Labelling(lambda ids, cfg: [], ("text",))

    def nested(ids, cfg):
        return []

    with pytest.raises(LabellingError, match="'test_a_lambda_or_nested_labelling_needs_a_name.<locals>.nested'"):
        Labelling(nested, ("text",))
    assert Labelling(nested, ("text",), name="mine").name == "mine"
    assert Labelling(_digits_of, ("text",)).name == "tests.search.test_labelling._digits_of"


@pytest.mark.slow
def test_search_and_load_with_the_users_labelling(tmp_path):
    from kvplan.evaluation import get_model
    from kvplan.search import search

    from kvplan.evaluation.tasks import doc_sources

    model, tok = get_model()
    lab = _numbers_labelling(tok)
    # a small task of the user's (9 records: calibration, validation, test), numbers in every history
    task = tmp_path / "numbers.jsonl"
    task.write_text("".join(json.dumps({"id": name, "history": "In 1991, 12 of the 345 modules were rewritten. "
                                        + text[:600], "question": "Which topic is this?", "answer": name}) + "\n"
                            for name, text in doc_sources()[:9]))
    out = tmp_path / "plan.yaml"
    search((model, tok), budget="3.3bpv", task=str(task), context_len=2048, n_trials=3, profile=False,
           progress=False, out=out, labelling=lab, residual_lengths=(0,), group_sizes=(32,))
    plan = kvplan.Plan.from_yaml(out)
    assert plan.labelling == "tests.numbers" and set(plan.modalities) == {"text", "number"}
    assert "labelling: tests.numbers" in out.read_text()

    # deployed without it: refused, naming the plan's labelling
    with pytest.raises(PlanError, match="searched with the token labelling 'tests.numbers'"):
        kvplan.load(model, out)
    # with it: every committed token at its label's bits
    prompt = "In 1991, 12 of the 345 modules were rewritten; by 2004 only 6 remained. " * 8
    inputs = tok(prompt, return_tensors="pt")
    labels = lab(inputs.input_ids, model.config)[0]
    assert "number" in labels
    kvplan.load(model, out, labelling=lab)
    try:
        gen = model.generate(**inputs, max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    finally:
        kvplan.unload(model)
    table, sink, sink_bits = plan.table(), plan.quantizer.sink_length, plan.quantizer.sink_bits
    checked = 0
    for layer in range(plan.geometry.num_layers):
        for k, kind in enumerate(("k", "v")):
            for h, bits in enumerate(gen.cache.token_bits(layer, kind)):
                for t, b in enumerate(bits):
                    want = sink_bits if t < sink else table[layer, h, k, plan.modalities.index(labels[t])]
                    assert b == want, (layer, kind, h, t)
                    checked += 1
    assert checked > 0


def test_plan_file_records_the_labelling_by_name(tmp_path):
    from kvplan import Geometry, baseline_plan

    g = Geometry(num_layers=2, num_kv_heads=2, head_dim=16, layer_types=("full", "full"), model_type="llama")
    plan = baseline_plan("int4", g, modalities=("text", "code")).replace(labelling="my.code")
    text = plan.to_yaml()
    assert "labelling: my.code" in text and "labelling" not in baseline_plan("int4", g).to_yaml()
    assert kvplan.Plan.from_yaml(text).labelling == "my.code"
    from kvplan.explain import explain

    (tmp_path / "plan.yaml").write_text(text)
    report = explain(tmp_path / "plan.yaml", importance=False)
    assert "token labelling: my.code (searched with this kvplan.Labelling" in report
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("labelling: my.code", "labelling: 3"))
    with pytest.raises(PlanError, match=r"labelling: must be a non-empty string"):
        kvplan.Plan.from_yaml(bad)


def _first_tokens_labelling(n):
    def first_tokens(input_ids, config):
        return [["sys" if t < n else "text" for t in range(len(row))] for row in input_ids.tolist()]

    return Labelling(first_tokens, modalities=("text", "sys"), name=f"tests.first{n}")


def _sys_plan(model, name):
    """Text at 2 bits, ``sys`` tokens at 8, every token committed in groups of 32 (no residual window)."""
    import numpy as np

    from kvplan import Geometry, Plan

    g = Geometry.of(model)
    table = np.full((g.num_layers, g.num_kv_heads, 2, 2), 2, dtype=np.int64)
    table[..., 1] = 8
    plan = Plan.from_table(table, g, modalities=("text", "sys")).replace(labelling=name)
    return plan.replace(quantizer=plan.quantizer.__class__(**{**plan.quantizer.__dict__, "group_size": 32,
                                                              "residual_length": 0}))


def test_a_labelling_by_position_labels_each_padded_row_as_its_prompt_alone():
    """The labelling was given the padded ids without the mask: "the first 16 tokens" fell on the padding of
    a left-padded row, its own first tokens were stored at the text bits, silently (the search labels each
    prompt alone, unpadded)."""
    from tests.tiny_models import tiny_llama

    lab = _first_tokens_labelling(16)
    prompt = torch.randint(3, 250, (1, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.cat([torch.zeros(1, 24, dtype=torch.long), torch.ones(1, 40, dtype=torch.long)], 1)
    padded = torch.cat([torch.zeros(1, 24, dtype=torch.long), prompt], 1)
    assert lab(padded, None, mask)[0] == ["text"] * 24 + lab(prompt, None)[0]
    model = tiny_llama()
    kvplan.load(model, _sys_plan(model, lab.name), labelling=lab, attention="dequantize")
    try:
        out = model.generate(input_ids=padded, attention_mask=mask, max_new_tokens=1, do_sample=False,
                             return_dict_in_generate=True, pad_token_id=0)
        bits = out.cache.token_bits(0, "k")[0]
        assert bits[24:24 + 32] == [8] * 16 + [2] * 16  # the prompt's committed tokens, as searched
        # rows padded differently disagree on what each position is: one line, not a silent mislabelling
        two = torch.cat([torch.randint(3, 250, (1, 64)), padded])
        with pytest.raises(kvplan.errors.CacheError, match="batch rows disagree on the modality of position 24"):
            model.generate(input_ids=two, attention_mask=torch.cat([torch.ones(1, 64, dtype=torch.long), mask]),
                           max_new_tokens=1, do_sample=False, pad_token_id=0)
    finally:
        kvplan.unload(model)


def test_a_cache_passed_to_generate_is_refused_under_another_labelling_than_its_plans():
    """make_cache refused a plan searched with another labelling, but a KVPlanCache passed to generate was
    labelled by the model's labelling unchecked: the plan's ``sys`` tokens were stored at the text bits."""
    from tests.tiny_models import tiny_llama

    model = tiny_llama()
    cache = kvplan.KVPlanCache(_sys_plan(model, "tests.first32"), model)
    kvplan.load(model, "int4", attention="dequantize")  # the default labelling: token ids
    try:
        with pytest.raises(PlanError, match="searched with the token labelling 'tests.first32', but this model "
                                            "labels prompts with 'token-ids'"):
            model.generate(input_ids=torch.randint(3, 250, (1, 64)), past_key_values=cache, max_new_tokens=1,
                           do_sample=False)
        assert cache.get_seq_length() == 0
    finally:
        kvplan.unload(model)
