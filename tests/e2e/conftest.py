"""End-to-end tests run train.py and the tools as a user does, on the demo corpus unless they name other
data: the corpus is prepared once per session before the first of them (tests/conftest.py's
demo_prepared), whichever lane of `make test` reaches one first, so no test depends on another having
prepared it (a test run alone, or first, found no corpus)."""

import pytest


@pytest.fixture(autouse=True, scope="session")
def _demo_corpus_prepared(demo_prepared):
    return demo_prepared
