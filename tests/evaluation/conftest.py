import pytest


@pytest.fixture(scope="session")
def smol():
    """The embedded default model (loaded once per test session)."""
    from kvplan.evaluation import get_model

    return get_model()


@pytest.fixture(scope="session")
def doc_samples(smol):
    from kvplan.evaluation import default_task_samples

    return default_task_samples(smol[1], split="test", n=3, history_tokens=256, eval_tokens=16)


@pytest.fixture(scope="session")
def prepared(smol, doc_samples):
    from kvplan.evaluation import pad_token_id, prepare_samples

    return prepare_samples(smol[0], doc_samples, pad_id=pad_token_id(smol[1]), progress=False)
