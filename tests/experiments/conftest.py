"""The studies' tests run on the session's tiny trained pair (tests/conftest.py: tiny_pair_dir), each module
with the session's persistent compilation cache switched on (shared with the study notebooks' kernels)."""

import pytest

from tests.study_helpers import persistent_compile_cache


@pytest.fixture(scope="module", autouse=True)
def _study_cache(study_cache_dir):
    with persistent_compile_cache(study_cache_dir):
        yield
