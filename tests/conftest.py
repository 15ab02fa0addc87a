"""Shared fixtures: the embedded default model, loaded once per test session."""

import pytest


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)`` of the embedded SmolLM2-135M-Instruct (fp32, CPU)."""
    from kvplan.models import load_model

    return load_model()
