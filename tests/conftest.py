import os
import tempfile

import pytest
import torch
import torch.distributed as dist

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Inductor is kareus's default codegen; it compiles each graph in seconds (tens on these
# CPUs), too slow for hundreds of tests that check the passes' graphs. They run the python
# codegen (the same rewritten graphs, run op by op); tests/test_inductor.py and the tests
# that pass codegen="inductor" check the default path. The processes tests start inherit it.
os.environ.setdefault("KAREUS_CODEGEN", "python")
# The suite never changes a GPU's settings, on a GPU machine either: KAREUS_CLOCKS=off makes
# every real controller refuse (here and in the processes tests start), and the real NVML's
# setters are replaced by a recorder that refuses too (Zeus calls them through that module).
# Tests that exercise setters install a fake NVML (tests/test_gpu_identity.py's ``nvml``
# fixture, which turns the switch on for that test) or an emulated controller.
os.environ["KAREUS_CLOCKS"] = "off"
REAL_SETTER_CALLS: list[str] = []
_SETTERS = ("nvmlDeviceSet", "nvmlDeviceReset", "nvmlDeviceClear")


class RealSetterCalled(RuntimeError):
    """A test reached a real NVML setter."""


def _guard_real_nvml() -> None:
    try:
        import pynvml
    except ImportError:
        return
    for name in dir(pynvml):
        if name.startswith(_SETTERS) and callable(getattr(pynvml, name)):

            def refuse(*_args, _name=name, **_kwargs):
                REAL_SETTER_CALLS.append(_name)
                raise RealSetterCalled(f"a test called the real NVML setter {_name}")

            setattr(pynvml, name, refuse)


_guard_real_nvml()


# ---- KAREUS_BREAK: kareus broken on purpose, to show that the tests see its effects ----------
# (kareus.testing.breaks: here, and in every rank run_ranks starts)
from kareus.testing.breaks import break_kareus  # noqa: E402 - after the environment above

break_kareus()
# Traces cached by the tests stay in the test run (and reach the processes it starts),
# shared by its workers (pytest-xdist's run id): a workload traced by a test on one worker
# is not traced again on the other (entries are written atomically).
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")
if _RUN:
    _CACHE = os.path.join(tempfile.gettempdir(), f"kareus-test-cache-{_RUN}")
    os.makedirs(_CACHE, exist_ok=True)
    os.environ["KAREUS_CACHE_DIR"] = _CACHE
else:
    os.environ["KAREUS_CACHE_DIR"] = tempfile.mkdtemp(prefix="kareus-test-cache-")


@pytest.fixture
def clocks_on(monkeypatch):
    """KAREUS_CLOCKS=on for a test whose controllers reach only fake or mocked setters."""
    monkeypatch.setenv("KAREUS_CLOCKS", "on")


@pytest.fixture(autouse=True)
def _no_real_setter():
    # Kareus swallows a controller's errors so that training goes on: a refused call is
    # caught here, after the test, whatever caught it inside.
    before = len(REAL_SETTER_CALLS)
    yield
    called = REAL_SETTER_CALLS[before:]
    assert not called, f"the test called real NVML setters: {called}"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Dynamo's caches and recompile limit leak across tests.
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


def pytest_collection_modifyitems(config, items):
    # CI (CI=true) keeps within its time budget by leaving out the few tests marked slow
    # (docs/development.md lists them), unless KAREUS_SLOW_TESTS=1; everywhere else they run.
    slow = os.environ.get("CI") and os.environ.get("KAREUS_SLOW_TESTS") != "1"
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "slow" in item.keywords and slow:
            item.add_marker(pytest.mark.skip(reason="marked slow: CI=true leaves it out"))


@pytest.fixture(scope="module")
def one_rank():
    """A gloo process group of one rank (the default group) for a test file's tests: a
    tensor-parallel model on it holds every collective, so its layers split as at TP 8."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
