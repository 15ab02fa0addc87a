"""Shared fixtures: the embedded default model, loaded once per test session."""

import os

import pytest

# Without a GPU, Triton kernels run under Triton's CPU interpreter; it must be set before
# triton is first imported.
if os.environ.get("TRITON_INTERPRET") is None:
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:
        pass


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)`` of the embedded SmolLM2-135M-Instruct (fp32, CPU)."""
    from kvplan.models import load_model

    return load_model()
