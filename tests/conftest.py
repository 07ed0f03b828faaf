import os
import tempfile

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Traces cached by the tests stay in the test run (and reach the processes it starts).
os.environ["KAREUS_CACHE_DIR"] = tempfile.mkdtemp(prefix="kareus-test-cache-")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Dynamo's caches and recompile limit leak across tests.
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
