import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """One intra-op thread: on the shared 2-core CI box 2 OpenMP threads per process were ~10x slower."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


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
