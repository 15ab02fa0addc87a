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
    # the conversion (which parses the file once, see loading._gguf_parsed_once) is transformers' own
    import transformers

    m0 = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf)
    tok0 = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    s0 = m0.state_dict()
    assert s0.keys() == s1.keys() and all(torch.equal(s0[k], s1[k]) for k in s0)
    assert tok0(text).input_ids == tok1(text).input_ids and tok0.get_vocab() == tok1.get_vocab()
    assert m0.config.to_dict() == {**m1.config.to_dict(), "_name_or_path": m0.config._name_or_path}



def test_load_model_freezes_the_model_and_leaves_torchs_grad_mode_alone(smollm2):
    """A library load must not switch off autograd for the user's whole process (it used to call
    ``torch.set_grad_enabled(False)``): the model's own parameters are frozen instead."""
    model, tok = smollm2
    assert torch.is_grad_enabled()
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    logits = model(torch.tensor([tok("a KV cache").input_ids])).logits
    assert not logits.requires_grad and logits.grad_fn is None
    x = torch.ones(2, requires_grad=True)
    assert (x * 2).sum().grad_fn is not None  # the user's own tensors still record gradients


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


class _Config:
    def to_dict(self):
        return {}

    @classmethod
    def from_dict(cls, d):
        return cls()

    def save_pretrained(self, path):
        with open(os.path.join(path, "config.json"), "w") as f:
            f.write("{}")


class _Saves:
    """A model / tokenizer stand-in whose saves write a file, or raise ``error``."""

    def __init__(self, error=None):
        self.error = error
        self.config = _Config()

    def save_pretrained(self, path):
        if self.error is not None:
            raise self.error
        with open(os.path.join(path, "tokenizer.json"), "w") as f:
            f.write("{}")


def test_a_full_disk_while_caching_does_not_fail_the_load(tmp_path, monkeypatch):
    """safetensors reports a full disk as its own SafetensorError (no OSError): the load failed with an
    internal error where the cache should just be skipped."""
    from safetensors import SafetensorError

    import safetensors.torch
    from kvplan.models.loading import _save_converted

    def full(*a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_model", full)
    with pytest.warns(UserWarning, match="not cached .*No space left on device"):
        _save_converted(_Saves(), _Saves(), str(tmp_path / "converted" / "abc"))
    assert os.listdir(tmp_path / "converted") == []  # its temporary folder removed


def test_a_conversion_another_process_cached_first_is_kept_without_a_warning(tmp_path, monkeypatch):
    """Two processes converting one file: the second rename met the first's folder and warned that nothing was
    cached, although the first's copy was there and used."""
    import warnings

    import safetensors.torch
    from kvplan.models.loading import _save_converted

    monkeypatch.setattr(safetensors.torch, "save_model", lambda model, path, metadata=None: open(path, "w").close())
    target = tmp_path / "converted" / "abc"
    target.mkdir(parents=True)
    (target / "model.safetensors").write_text("the winner's")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _save_converted(_Saves(), _Saves(), str(target))
    assert (target / "model.safetensors").read_text() == "the winner's"
    assert sorted(os.listdir(tmp_path / "converted")) == ["abc"]


def test_temporary_folders_of_killed_conversions_are_swept(tmp_path, monkeypatch):
    """kill -9 during the cache write left a .tmp-* folder (up to a whole converted model) for good."""
    import time

    import safetensors.torch
    from kvplan.models import loading

    monkeypatch.setattr(safetensors.torch, "save_model", lambda model, path, metadata=None: open(path, "w").close())
    converted = tmp_path / "converted"
    old, fresh = converted / ".tmp-killed", converted / ".tmp-running"
    for folder in (old, fresh):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_text("partial")
    past = time.time() - loading.STALE_TEMPORARY_S - 60
    os.utime(old, (past, past))
    loading._save_converted(_Saves(), _Saves(), str(converted / "abc"))
    assert sorted(os.listdir(converted)) == [".tmp-running", "abc"]  # another conversion's, minutes old, stays


def test_a_gguf_file_cut_off_in_its_header_is_one_line(tmp_path, monkeypatch):
    """An interrupted download: a struct.error from the GGUF reader escaped as an internal error."""
    from kvplan.errors import ModelLoadError
    from kvplan.models import loading

    monkeypatch.setenv("KVPLAN_CACHE_DIR", str(tmp_path / "cache"))
    folder, gguf = loading.default_model_path()
    with open(os.path.join(folder, gguf), "rb") as f:
        (tmp_path / "cut.gguf").write_bytes(f.read(1000))
    with pytest.raises(ModelLoadError, match=r"cannot load model '.*cut.gguf': ") as e:
        loading.load_model(str(tmp_path / "cut.gguf"))
    assert "\n" not in str(e.value)


def test_a_file_given_as_the_model_directory_is_named(tmp_path):
    """``--model <dir>/config.json``: transformers read the config, then torch.load()ed the JSON as weights."""
    from kvplan import load_model
    from kvplan.errors import ModelLoadError
    from tests.tiny_models import tiny_llama

    tiny_llama().save_pretrained(tmp_path / "m")
    with pytest.raises(ModelLoadError, match=r"model path .*config.json is a file: give the model's directory"):
        load_model(str(tmp_path / "m" / "config.json"))


def test_a_gemma3_file_cut_short_is_assembled_again(tmp_path, monkeypatch):
    """The chunk package writes straight to its target: a kill or a full disk left a file whose sha256 every
    later load refused, with advice (overwrite=True) a CLI user cannot follow."""
    import importlib
    import importlib.util

    from kvplan.models import loading

    whole = b"the whole model file"
    calls = []

    class Package:
        MODEL_NAME = "model.gguf"

        @staticmethod
        def assemble(path, overwrite=False):
            calls.append((os.path.basename(path), overwrite))
            if os.path.exists(path) and not overwrite:
                if open(path, "rb").read() != whole:
                    raise FileExistsError(f"{path} already exists with an unexpected sha256")
                return path
            with open(path, "wb") as f:
                f.write(whole)
            return path

    real_find, real_import = importlib.util.find_spec, importlib.import_module
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == loading._GEMMA3_PACKAGE
                        else real_find(n, *a))
    monkeypatch.setattr(importlib, "import_module", lambda n, *a: Package if n == loading._GEMMA3_PACKAGE
                        else real_import(n, *a))
    monkeypatch.setenv("KVPLAN_CACHE_DIR", str(tmp_path))
    (tmp_path / "model.gguf").write_bytes(whole[:5])  # what a killed assembly leaves
    assert loading.gemma3_model_path() == (str(tmp_path), "model.gguf")
    assert (tmp_path / "model.gguf").read_bytes() == whole and sorted(os.listdir(tmp_path)) == ["model.gguf"]
    assert calls == [("model.gguf", False), (f"model.gguf.tmp-{os.getpid()}", True)]
    assert loading.gemma3_model_path() == (str(tmp_path), "model.gguf") and calls[-1] == ("model.gguf", False)


def _stub_conversion(tmp_path, monkeypatch) -> str:
    """A cached conversion of the default model under a fresh KVPLAN_CACHE_DIR whose files are present but
    are not a model; returns its folder."""
    from kvplan.models import loading

    monkeypatch.setenv("KVPLAN_CACHE_DIR", str(tmp_path))
    folder, gguf = loading.default_model_path()
    converted = loading.converted_gguf_dir(os.path.join(folder, gguf))
    os.makedirs(converted)
    for name in ("config.json", "model.safetensors"):
        with open(os.path.join(converted, name), "w") as f:
            f.write("{}")
    return converted


def test_a_broken_cached_conversion_names_its_folder(tmp_path, monkeypatch):
    from kvplan.errors import ModelLoadError
    from kvplan.models import loading

    converted = _stub_conversion(tmp_path, monkeypatch)
    with pytest.raises(ModelLoadError) as e:
        loading.load_model()
    assert converted in str(e.value) and "delete that folder" in str(e.value) and "\n" not in str(e.value)


def test_a_vlm_processor_that_needs_torchvision_is_one_line(tmp_path, monkeypatch, capsys):
    """Without torchvision transformers cannot build a LLaVA-OneVision / Qwen2.5-VL processor
    (their video processors import it): one line naming the command that installs the pair."""
    import transformers

    from kvplan.cli import main
    from kvplan.evaluation import named_plan
    from tests.tiny_models import tiny_llava_onevision

    model = tiny_llava_onevision()
    model.save_pretrained(tmp_path / "vlm")
    named_plan("int4", model, modalities=("text", "visual")).to_yaml(tmp_path / "plan.yaml")

    def no_torchvision(*args, **kwargs):
        raise ImportError("\nLlavaOnevisionVideoProcessor requires the Torchvision library but it was not found in "
                          "your environment.\nCheck out the instructions on the installation page ...")

    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", no_torchvision)
    capsys.readouterr()
    code = main(["validate", str(tmp_path / "plan.yaml"), "--model", str(tmp_path / "vlm")])
    err = [line for line in capsys.readouterr().err.strip().splitlines()
           if not line.startswith("Loading weights")]  # transformers' progress bar of the weights it read
    assert code == 2 and len(err) == 1, err
    assert "cannot load the processor of model" in err[0] and "requires the Torchvision library" in err[0]
    assert "pip install torch==2.14.1 torchvision==0.29.1" in err[0]


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def test_a_truncated_safetensors_file_is_a_model_load_error(tmp_path):
    """safetensors' own ``SafetensorError`` (neither OSError nor ValueError) used to escape unwrapped."""
    from kvplan import load_model
    from kvplan.errors import ModelLoadError
    from tests.tiny_models import tiny_llama

    tiny_llama().save_pretrained(tmp_path / "m")
    _truncate(tmp_path / "m" / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"cannot load model .*: .*") as e:
        load_model(str(tmp_path / "m"))
    assert "\n" not in str(e.value) and "delete that folder" not in str(e.value)


def test_a_truncated_cached_conversion_says_to_delete_its_folder(tmp_path, monkeypatch):
    from kvplan.errors import ModelLoadError
    from kvplan.models import loading
    from tests.tiny_models import tiny_llama

    monkeypatch.setenv("KVPLAN_CACHE_DIR", str(tmp_path))
    folder, gguf = loading.default_model_path()
    converted = loading.converted_gguf_dir(os.path.join(folder, gguf))
    tiny_llama().save_pretrained(converted)  # a real config.json, a damaged model.safetensors
    _truncate(os.path.join(converted, "model.safetensors"))
    with pytest.raises(ModelLoadError) as e:
        loading.load_model()
    assert converted in str(e.value) and "delete that folder" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float64, "float8", "int8", "Float16", 16])
def test_a_bad_dtype_is_named_and_not_blamed_on_the_cached_conversion(tmp_path, monkeypatch, dtype):
    """A cache-backed load used to answer a bad dtype with 'delete that folder to convert again'."""
    from kvplan.errors import ModelLoadError
    from kvplan.models import loading

    converted = _stub_conversion(tmp_path, monkeypatch)
    with pytest.raises(ModelLoadError, match="unsupported dtype .*float32, float16 or bfloat16") as e:
        loading.load_model(dtype=dtype)
    assert "delete that folder" not in str(e.value) and converted not in str(e.value)


@pytest.mark.parametrize("device, message", [("bogus", "unknown device 'bogus'"), (3.5, "unknown device 3.5"),
                                             ("cuda:0", "device 'cuda:0': no cuda device is available"),
                                             ("mps", "device 'mps': no mps device is available")])
def test_a_bad_or_absent_device_is_refused_before_any_weights_are_read(tmp_path, monkeypatch, device, message):
    """``load_model(device="bogus")`` used to load the whole model, then raise torch's own RuntimeError."""
    from kvplan.errors import ModelLoadError
    from kvplan.models import loading

    if device == "cuda:0" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    read = []
    monkeypatch.setattr(loading, "_load", lambda *a: read.append(a) or (torch.nn.Linear(1, 1), None))
    with pytest.raises(ModelLoadError, match=message) as e:
        loading.load_model(str(tmp_path), device=device)
    assert not read and "\n" not in str(e.value)


@pytest.mark.parametrize("device", [None, "", "cpu", torch.device("cpu")])
def test_a_cpu_device_is_taken_as_a_name_or_a_torch_device(tmp_path, monkeypatch, device):
    from kvplan.models import loading

    monkeypatch.setattr(loading, "_load", lambda *a: (torch.nn.Linear(1, 1), None))
    model, _ = loading.load_model(str(tmp_path), device=device)
    assert next(model.parameters()).device.type == "cpu"


@pytest.mark.parametrize("dtype, expected", [(None, None), (torch.float32, torch.float32), ("float32", torch.float32),
                                             (torch.float16, torch.float16), ("float16", torch.float16),
                                             (torch.bfloat16, torch.bfloat16), ("bfloat16", torch.bfloat16)])
def test_dtype_takes_a_torch_dtype_or_its_name(tmp_path, monkeypatch, dtype, expected):
    from kvplan.models import loading

    seen = {}

    def fake_load(transformers, name, source, kwargs):
        seen.update(kwargs)
        return torch.nn.Linear(1, 1), None

    monkeypatch.setattr(loading, "_load", fake_load)
    loading.load_model(str(tmp_path), dtype=dtype)
    assert seen.get("dtype") is expected


@pytest.mark.parametrize("name", ["{tmp}/does/not/exist", "{tmp}/missing", "./no-such-dir", "../no-such-dir",
                                  "sub/no-such-model", "~/no-such-model"])
def test_a_missing_local_path_is_not_found(tmp_path, monkeypatch, name):
    """Path-like names that do not exist used to reach the hub and come back as repo-id syntax errors."""
    from kvplan.errors import ModelLoadError
    from kvplan.models import loading

    def no_hub(*args):
        raise AssertionError("a path-like name reached transformers")

    monkeypatch.setattr(loading, "_load", no_hub)
    (tmp_path / "cwd" / "sub").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.setenv("HOME", str(tmp_path))
    name = name.format(tmp=tmp_path)
    with pytest.raises(ModelLoadError, match="model directory not found: ") as e:
        loading.load_model(name)
    assert str(e.value).endswith(name)


@pytest.mark.parametrize("name, source", [("someorg/some-model", "someorg/some-model"), ("gpt2", "gpt2"),
                                          ("~/models/m", "{home}/models/m"), ("./models/m", "./models/m")])
def test_hub_ids_and_existing_paths_reach_transformers(tmp_path, monkeypatch, name, source):
    """A hub id (even one whose first part is no local folder) still goes to transformers, and ``~`` is expanded."""
    from kvplan.models import loading

    seen = []

    def fake_load(transformers, name, source, kwargs):
        seen.append(source)
        return torch.nn.Linear(1, 1), None

    monkeypatch.setattr(loading, "_load", fake_load)
    (tmp_path / "models" / "m").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    loading.load_model(name)
    assert seen == [source.format(home=tmp_path)]


@pytest.mark.parametrize("suffix", [".gguf", ".GGUF", ".Gguf"])
def test_a_gguf_file_is_recognised_whatever_the_case_of_its_suffix(tmp_path, monkeypatch, suffix):
    """``*.GGUF`` used to go to transformers as a model directory: 'config file ... is not a valid JSON file'."""
    from kvplan.errors import ModelLoadError
    from kvplan.models import loading

    seen = []

    def fake_load(transformers, name, source, kwargs):
        seen.append((source, kwargs.get("gguf_file")))
        return torch.nn.Linear(1, 1), None

    monkeypatch.setattr(loading, "_load", fake_load)
    monkeypatch.setenv("KVPLAN_MODEL_CACHE", "0")
    folder, gguf = loading.default_model_path()
    link = tmp_path / f"model{suffix}"
    link.symlink_to(os.path.join(folder, gguf))
    monkeypatch.setenv("HOME", str(tmp_path))
    loading.load_model(str(link))
    loading.load_model(f"~/model{suffix}")
    assert seen == [(str(tmp_path), link.name)] * 2
    with pytest.raises(ModelLoadError, match=f"GGUF file not found: .*missing{suffix}"):
        loading.load_model(str(tmp_path / f"missing{suffix}"))


def test_eval_and_sweep_name_a_bad_dtype_as_load_model_does():
    """``get_model`` (eval, sweep, search) passes the dtype name on: one ModelLoadError, not an AttributeError."""
    from kvplan.errors import ModelLoadError
    from kvplan.evaluation.runs import get_model

    with pytest.raises(ModelLoadError, match="unsupported dtype 'float8'"):
        get_model(dtype="float8")


def test_a_model_folder_without_a_tokenizer_says_what_transformers_tried(tmp_path):
    """The message stopped at "Couldn't instantiate the backend tokenizer from one of:", its list dropped."""
    from kvplan import load_model
    from kvplan.errors import ModelLoadError
    from tests.tiny_models import tiny_llama

    tiny_llama().save_pretrained(tmp_path / "m")  # weights and config, no tokenizer
    with pytest.raises(ModelLoadError, match=r"from one of: \(1\) a `tokenizers` library serialization file, "
                                             r"\(2\) .*sentencepiece") as e:
        load_model(str(tmp_path / "m"))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name, hint", [("smollm", "did you mean 'smollm2-135m', a kvplan built-in model?"),
                                        ("Gemma3-270", "did you mean 'gemma3-270m', a kvplan built-in model?"),
                                        ("someorg/some-model", "kvplan's built-in models: smollm2-135m or "
                                                               "gemma3-270m; or a local directory or .gguf file")])
def test_a_name_the_hub_cannot_give_says_which_names_kvplan_knows(monkeypatch, name, hint):
    """A misspelt built-in name (``smollm``) went to the hub: offline, after ~30 s of retries, the error said
    only that huggingface.co could not be reached, with no word of the names kvplan loads itself."""
    from kvplan.errors import ModelLoadError
    from kvplan.models import loading

    def offline(transformers, name, source, kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them "
                      "in the cached files.")

    monkeypatch.setattr(loading, "_load", offline)
    with pytest.raises(ModelLoadError) as e:
        loading.load_model(name)
    assert str(e.value) == (f"cannot load model {name!r}: We couldn't connect to 'https://huggingface.co' to load "
                            f"the files, and couldn't find them in the cached files. ({hint})")


def test_a_local_path_that_fails_to_load_gets_no_hub_hint(tmp_path, monkeypatch):
    from kvplan.errors import ModelLoadError
    from kvplan.models import loading

    def broken(transformers, name, source, kwargs):
        raise OSError("no config.json")

    monkeypatch.setattr(loading, "_load", broken)
    with pytest.raises(ModelLoadError) as e:
        loading.load_model(str(tmp_path))
    assert str(e.value) == f"cannot load model {str(tmp_path)!r}: no config.json"
