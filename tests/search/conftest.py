"""Fixtures of the search tests: a throwaway PostgreSQL server (see :mod:`tests.postgres`)."""

import itertools

import pytest

from tests.postgres import create_database, postgres_server, require_postgres

_n = itertools.count()


@pytest.fixture(scope="session")
def postgres_server_url():
    """URL of a PostgreSQL server started for this test session (skips without one, fails in CI)."""
    require_postgres()
    with postgres_server() as url:
        yield url


@pytest.fixture
def postgres_url(postgres_server_url):
    """A fresh, empty database on the session's server: ``postgresql://kvplan@127.0.0.1:PORT/tN``."""
    return create_database(postgres_server_url, f"t{next(_n)}")
