"""The engine suites on a CUDA GPU (bench/gpu_check.sh runs them there). Skipped, with
the reason, where PyTorch sees no GPU.

On a GPU machine without the default model, point PARLEY_TEST_TOKENIZER at a tokenizer
folder (bench/gpu_check.sh says how to make one): the tiny engines need only its
vocabulary.
"""

from __future__ import annotations

import os

import pytest
import torch

NO_GPU = "needs a CUDA GPU: bench/gpu_check.sh runs these on one"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NO_GPU)
    for item in items:
        if "tests/gpu/" in item.nodeid:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _room_for_recompiles():
    """These suites build engines of other dtypes, head sizes, cache sizes and batch sizes
    in one process, each a new FlexAttention compilation: past dynamo's recompile limit (8)
    the call runs eagerly, and eager flex_attention cannot be captured in a CUDA graph (the
    requests fail). A server builds one engine; give the suites the room of many."""
    import torch._dynamo

    old = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = 256
    yield
    torch._dynamo.config.recompile_limit = old


@pytest.fixture(scope="session")
def tokenizer(request):
    folder = os.environ.get("PARLEY_TEST_TOKENIZER")
    if folder:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder)
    return request.getfixturevalue("smollm").tokenizer
