"""Model loading: the GGUF conversion cache gives the model the GGUF file gives, bit for bit."""

import os

import pytest
import torch


@pytest.mark.slow
def test_gguf_conversion_is_cached_and_identical(tmp_path, monkeypatch):
    from kvplan.models import loading

    monkeypatch.setenv("KVPLAN_CACHE_DIR", str(tmp_path))
    folder, gguf = loading.default_model_path()
    converted = loading.converted_gguf_dir(os.path.join(folder, gguf))
    assert converted.startswith(str(tmp_path)) and not os.path.exists(converted)

    m1, tok1 = loading.load_model()  # converts the GGUF file and saves the result
    assert os.path.isfile(os.path.join(converted, "model.safetensors"))
    assert not [p for p in os.listdir(os.path.dirname(converted)) if p.startswith(".tmp-")]
    m2, tok2 = loading.load_model()  # reads the saved folder
    assert m2.config._name_or_path == converted and m1.config._name_or_path == folder

    s1, s2 = m1.state_dict(), m2.state_dict()
    assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)
    assert m2.lm_head.weight.data_ptr() == m2.model.embed_tokens.weight.data_ptr()  # ties kept
    text = "def f(x):\n    return x ** 2  # Ünïcode, tabs\tand <|im_end|> specials"
    assert tok1(text).input_ids == tok2(text).input_ids
    msgs = [{"role": "user", "content": "What is a KV cache?"}]
    assert tok1.apply_chat_template(msgs, tokenize=False) == tok2.apply_chat_template(msgs, tokenize=False)
    ids = torch.tensor([tok1(text * 4).input_ids])
    assert torch.equal(m1(ids).logits, m2(ids).logits)



@pytest.mark.parametrize("value, enabled", [(None, True), ("1", True), ("0", False), ("off", False), ("False", False)])
def test_model_cache_switch(monkeypatch, value, enabled):
    from kvplan.models.loading import model_cache_enabled

    if value is None:
        monkeypatch.delenv("KVPLAN_MODEL_CACHE", raising=False)
    else:
        monkeypatch.setenv("KVPLAN_MODEL_CACHE", value)
    assert model_cache_enabled() is enabled


def test_unwritable_cache_does_not_fail_the_load(tmp_path):
    from kvplan.models.loading import _save_converted

    class Broken:
        config = None

        def save_pretrained(self, path):
            raise OSError("disk full")

    target = tmp_path / "converted" / "abc"
    blocker = tmp_path / "converted"
    blocker.write_text("a file where the cache folder should be")
    with pytest.warns(UserWarning, match="not cached"):
        _save_converted(Broken(), Broken(), str(target))  # no exception: the cache is skipped
    assert blocker.is_file() and not target.exists()


def test_a_broken_cached_conversion_names_its_folder(tmp_path, monkeypatch):
    from kvplan.errors import ModelLoadError
    from kvplan.models import loading

    monkeypatch.setenv("KVPLAN_CACHE_DIR", str(tmp_path))
    folder, gguf = loading.default_model_path()
    converted = loading.converted_gguf_dir(os.path.join(folder, gguf))
    os.makedirs(converted)
    for name in ("config.json", "model.safetensors"):  # present but not a model
        with open(os.path.join(converted, name), "w") as f:
            f.write("{}")
    with pytest.raises(ModelLoadError) as e:
        loading.load_model()
    assert converted in str(e.value) and "delete that folder" in str(e.value) and "\n" not in str(e.value)
