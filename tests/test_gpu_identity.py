"""One GPU identity, and a clock journal that stays small and tells the truth.

A fake NVML holds four GPUs; the process's CUDA view of them is permuted
(CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER), so that an index means a different GPU to CUDA,
NVML and nvidia-smi. Controllers, journal records, recovery and the advice printed must all
name the same GPU: by UUID.
"""

import json
import os
import subprocess
import sys
import types

import pytest
import torch

from kareus.runtime import journal
from kareus.runtime.clocks import ClockError, NvmlClocks, controller_for

UUIDS = ["GPU-aaaa", "GPU-bbbb", "GPU-cccc", "GPU-dddd"]


class FakeNvml(types.ModuleType):
    """NVML over four GPUs: their locked clocks live in ``locked``, by UUID."""

    NVML_ERROR_NO_PERMISSION = 4

    class NVMLError(Exception):
        def __init__(self, value=0):
            super().__init__(f"NVML error {value}")
            self.value = value

    def __init__(self, refuse=False):
        super().__init__("pynvml")
        self.locked = {}
        self.refuse = refuse

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, index):
        if not 0 <= index < len(UUIDS):
            raise self.NVMLError(2)
        return UUIDS[index]

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid not in UUIDS:
            raise self.NVMLError(2)
        return uuid

    def nvmlDeviceGetIndex(self, handle):
        return UUIDS.index(handle)

    def nvmlDeviceGetUUID(self, handle):
        return handle.encode()  # older bindings return bytes

    def nvmlDeviceSetGpuLockedClocks(self, handle, lo, hi):
        if self.refuse:
            raise self.NVMLError(self.NVML_ERROR_NO_PERMISSION)
        self.locked[handle] = lo

    def nvmlDeviceResetGpuLockedClocks(self, handle):
        if self.refuse:
            raise self.NVMLError(self.NVML_ERROR_NO_PERMISSION)
        self.locked.pop(handle, None)

    # what kareus doctor reads
    NVML_CLOCK_SM = 1

    def nvmlSystemGetDriverVersion(self):
        return b"550.54"

    def nvmlDeviceGetCount(self):
        return len(UUIDS)

    def nvmlDeviceGetName(self, handle):
        return b"NVIDIA H200"

    def nvmlDeviceGetClockInfo(self, handle, kind):
        return self.locked.get(handle, 1980)

    def nvmlDeviceGetMaxClockInfo(self, handle, kind):
        return 1980

    def nvmlDeviceGetSupportedMemoryClocks(self, handle):
        return [2619]

    def nvmlDeviceGetSupportedGraphicsClocks(self, handle, memory):
        return list(range(1980, 344, -15))

    def nvmlDeviceGetPowerManagementLimit(self, handle):
        return 700000


@pytest.fixture
def nvml(monkeypatch, clocks_on):
    """The fake NVML, in a process that sees no CUDA GPU (``_cuda_sees`` shows it some)."""
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return fake


def _cuda_sees(monkeypatch, visible):
    """Make this process a CUDA process whose device 0 is GPU ``visible[0]`` of NVML."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(map(str, visible)))
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    props = {i: types.SimpleNamespace(uuid=UUIDS[v][4:]) for i, v in enumerate(visible)}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])


@pytest.mark.parametrize("visible", [[2, 0], [3], [1, 2, 3, 0]])
def test_this_processs_gpu_is_named_by_uuid_whatever_cuda_numbers_it(monkeypatch, nvml, visible):
    _cuda_sees(monkeypatch, visible)
    clocks = NvmlClocks()
    assert clocks.uuid == UUIDS[visible[0]] and clocks.index == visible[0]
    assert clocks.device_key == f"gpu:{UUIDS[visible[0]]}"
    clocks.set(1200)
    assert nvml.locked == {UUIDS[visible[0]]: 1200}


def _dead_lock(path, **fields):
    # A lock by a process that ran on this host and is gone (a pid no process has).
    record = {"event": "lock", "pid": 2**22 + 7, "host": journal.HOST, "freq_mhz": 1200}
    record.update(boot=journal.BOOT, start=1, **fields)
    with path.open("a") as fh:
        fh.write(json.dumps(record) + "\n")


@pytest.mark.parametrize("controller", ["zeus", "nvml"])
def test_recovery_resets_the_recorded_gpu_under_another_processs_view(
    tmp_path, monkeypatch, nvml, controller
):
    path = tmp_path / "journal"
    nvml.locked[UUIDS[2]] = 1200  # locked by a run whose CUDA device 0 was NVML's GPU 2
    _dead_lock(path, gpu=0, uuid=UUIDS[2], controller=controller)
    _cuda_sees(monkeypatch, [1])  # the recovering process sees another GPU as device 0
    (message,) = journal.recover(path)
    assert nvml.locked == {} and "GPU-cccc" in message and "restored" in message, message
    assert json.loads(path.read_text().splitlines()[-1])["event"] == "recovered"
    assert journal.recover(path) == []  # done once


def test_a_lock_no_controller_can_reset_is_reported_not_restored(tmp_path, nvml):
    path = tmp_path / "journal"
    # a Zeus record before UUIDs: its index was a CUDA index of a process that is gone
    _dead_lock(path, gpu=1, controller="zeus")
    _dead_lock(path, gpu=0, uuid=UUIDS[3], controller="my-own-controller")
    messages = journal.recover(path)
    assert len(messages) == 2 and all("NOT restored" in m for m in messages), messages
    assert "`nvidia-smi -rgc -i 1`" in messages[0]
    assert "`nvidia-smi -rgc -i GPU-dddd`" in messages[1]
    assert "recovered" not in path.read_text()  # nothing claimed that did not happen
    assert len(journal.recover(path)) == 2  # and said again until it is reset


def test_the_running_processs_own_controller_of_the_same_kind_and_gpu_restores(tmp_path):
    path = tmp_path / "journal"
    _dead_lock(path, gpu=0, uuid=UUIDS[3], controller="my-own-controller")
    resets = []
    own = types.SimpleNamespace(
        journal_name="my-own-controller", uuid=UUIDS[3], reset=lambda: resets.append(1)
    )
    other = types.SimpleNamespace(journal_name="my-own-controller", uuid=UUIDS[0], reset=None)
    assert "NOT restored" in journal.recover(path, own=other)[0]
    assert "restored to the default clock" in journal.recover(path, own=own)[0]
    assert resets == [1]


def test_a_reset_without_permission_is_not_claimed(tmp_path, monkeypatch, clocks_on):
    path = tmp_path / "journal"
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(refuse=True))
    _dead_lock(path, gpu=2, uuid=UUIDS[2], controller="nvml")
    (message,) = journal.recover(path)
    assert "restoring it failed" in message and "GPU-cccc" in message, message
    assert json.loads(path.read_text().splitlines()[-1])["event"] == "restore_failed"


def test_liveness_is_pid_and_start_time_and_boot(tmp_path):
    parent = os.getppid()
    started = journal.process_start(parent)
    assert started is not None
    me = {"pid": parent, "start": started, "boot": journal.BOOT}
    assert journal.alive(me)
    assert not journal.alive(me | {"start": started + 1})  # the pid was reused
    assert not journal.alive(me | {"boot": "another-boot"})  # the host rebooted
    assert journal.alive({"pid": parent})  # a record before start times: the pid decides
    with subprocess.Popen([sys.executable, "-c", "pass"]) as child:
        child.wait()
    assert not journal.alive({"pid": child.pid, "start": 1, "boot": journal.BOOT})


def test_bad_lines_and_other_hosts_are_said_once_and_left(tmp_path, nvml):
    path = tmp_path / "journal"
    path.write_text("not json\n[1, 2]\n")
    _dead_lock(path, gpu=0, uuid=UUIDS[0], controller="nvml", host="another-host")
    messages = journal.recover(path)
    assert messages[0].endswith("2 line(s) are not clock-journal records and were skipped")
    assert "on host another-host may still have its clock locked" in messages[1]
    assert "GPU-aaaa" in messages[1] and len(messages) == 2


def test_controller_for_builds_by_uuid_and_refuses_what_it_cannot(nvml):
    assert controller_for("zeus", 0, UUIDS[1]).uuid == UUIDS[1]
    assert controller_for("nvml", 3).uuid == UUIDS[3]
    assert controller_for("zeus", 0) is None and controller_for("emulated", 0) is None
    with pytest.raises(ClockError):
        controller_for("nvml", 0, "GPU-not-here")


def test_a_failed_restore_names_the_gpu_by_uuid(tmp_path):
    from kareus.runtime.switcher import ClockRuntime, Step

    class Stuck:
        name = journal_name = "stuck"
        index, uuid, device_key = 5, "GPU-eeee", None

        def set(self, freq):
            pass

        def reset(self):
            raise ClockError("the driver refused")

    runtime = ClockRuntime([Step("forward", 1200)], Stuck(), journal=tmp_path / "j")
    runtime.switch(0, "forward")
    with pytest.warns(RuntimeWarning, match="nvidia-smi -rgc -i GPU-eeee"):
        runtime.close()
    events = [json.loads(line) for line in (tmp_path / "j").read_text().splitlines()]
    assert [e["event"] for e in events] == ["lock", "restore_failed"]
    assert all(e["uuid"] == "GPU-eeee" for e in events)


def test_doctor_on_a_machine_without_gpu_says_so_and_exits_0(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "kareus", "doctor", "--try-switch", "--json", str(tmp_path / "d")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    # the suite's KAREUS_CLOCKS=off reaches the command: on a GPU machine it skips the switch
    assert "clock changes by kareus: off" in out.stdout
    if torch.cuda.is_available():  # pragma: no cover - a GPU machine has other things to say
        assert "--try-switch skipped" in out.stderr and "KAREUS_CLOCKS=off" in out.stderr
        return
    assert "no GPU here" in out.stdout and "needs a GPU" in out.stderr
    assert json.loads((tmp_path / "d").read_text())["gpus"] == []


def test_doctor_names_every_gpu_by_uuid_and_both_indices(monkeypatch, nvml):
    from kareus.jobs.doctor import diagnose

    _cuda_sees(monkeypatch, [2, 0])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    report = diagnose()
    assert report.driver == "550.54" and len(report.gpus) == 4
    by_uuid = {g.uuid: g for g in report.gpus}
    assert by_uuid["GPU-cccc"].cuda_index == 0 and by_uuid["GPU-cccc"].nvml_index == 2
    assert by_uuid["GPU-aaaa"].cuda_index == 1 and by_uuid["GPU-bbbb"].cuda_index is None
    assert by_uuid["GPU-aaaa"].power_limit_w == 700 and by_uuid["GPU-aaaa"].sm_clock_mhz == 1980
    text = report.to_text()
    assert "GPU GPU-cccc: NVIDIA H200; NVML index 2, CUDA index 0" in text
    assert "may this process lock clocks" in text
    assert not nvml.locked  # reading changed nothing


def test_doctor_try_switch_measures_and_restores_every_gpu(monkeypatch, nvml):
    from kareus.jobs.doctor import diagnose, try_switches

    report = diagnose()
    switches = try_switches(report, settle_s=0.05)
    assert set(switches) == set(UUIDS) and not nvml.locked
    for sw in switches.values():
        assert sw["source"] == "measured" and sw["lock_call_s"] >= 0
        assert sw["target_mhz"] == 1485 and sw["transition_s"] is not None


def test_doctor_try_switch_restores_on_ctrl_c(monkeypatch, nvml):
    import signal

    from kareus.jobs.doctor import diagnose, try_switches

    report = diagnose()
    real_set = nvml.nvmlDeviceSetGpuLockedClocks

    def set_then_interrupt(handle, lo, hi):
        real_set(handle, lo, hi)
        signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(nvml, "nvmlDeviceSetGpuLockedClocks", set_then_interrupt)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        try_switches(report, settle_s=0.05)
    assert nvml.locked == {}  # the first GPU's clock went back; the others were never locked
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.slow  # CI's sample leaves out this full plan; the doctor's report stays in CI
def test_a_doctor_report_prices_clock_changes_in_kareus_plan(monkeypatch, nvml, tmp_path):
    """`kareus doctor --try-switch --json F` (fake NVML), then `kareus plan --gpu-profile F`:
    the plan prices each clock change with the slowest GPU's measured change, says so, and
    counts the changes; a report without a measured change is refused with what to run."""
    import dataclasses
    import json

    from kareus.cli import EXIT_BAD_INPUT, EXIT_OK, main
    from kareus.ir.plan_file import Plan
    from kareus.jobs.doctor import diagnose, try_switches, write_json

    report = diagnose()
    report.switches = try_switches(report, settle_s=0.05)
    path = tmp_path / "doctor.json"
    write_json(report, path)
    small = ["--model", "tiny-4l", "--tp", "2", "--microbatch-size", "4", "--seq-len", "32"]
    small += ["--solver-work", "0.05", "--clocks", "1410,1260,1095,945,780"]  # the switch price
    # is checked, not the proofs or the clock grid
    out = tmp_path / "out"
    args = ["plan", *small, "--quiet", "--out", str(out), "--gpu-profile", str(path)]
    assert main(args) == EXIT_OK
    plan = Plan.load(out / "plan.json")
    slowest = max(s["lock_call_s"] + s["transition_s"] for s in report.switches.values())
    assert plan.clock_switch["time_s"] == pytest.approx(slowest)
    assert "measured by kareus doctor" in plan.clock_switch["source"]
    assert plan.chosen.switches is not None
    assert "Clock changes per iteration" in (out / "report.md").read_text()
    empty = tmp_path / "empty.json"
    write_json(dataclasses.replace(report, switches={}), empty)
    args[-1] = str(empty)
    assert main(args) == EXIT_BAD_INPUT
    json.loads(empty.read_text())  # (a valid report, only without a measured change)


def test_a_users_controller_named_only_by_name_restores_its_own_lock(tmp_path):
    """A controller without ``journal_name`` is journalled by its ``name``; after a SIGKILL
    the next run holding one of that name restores with it instead of saying it cannot."""
    path = tmp_path / "journal"
    _dead_lock(path, gpu=0, controller="file")
    resets = []
    own = types.SimpleNamespace(name="file", index=0, reset=lambda: resets.append(1))
    (message,) = journal.recover(path, own=own)
    assert "restored to the default clock" in message and resets == [1], message


# ---- KAREUS_CLOCKS=off: no GPU setting changes, whatever a call asks ---------------------------


@pytest.mark.parametrize("value", ["off", "0", "OFF ", "of"])  # a typo counts as off
def test_kareus_clocks_off_refuses_every_real_setter(monkeypatch, nvml, value):
    from kareus.runtime.clocks import ClocksOffError, DryRunClocks, default_controller

    monkeypatch.setenv("KAREUS_CLOCKS", value)
    calls = []
    monkeypatch.setattr(nvml, "nvmlDeviceSetGpuLockedClocks", lambda *a: calls.append(a))
    monkeypatch.setattr(nvml, "nvmlDeviceResetGpuLockedClocks", lambda *a: calls.append(a))
    clocks = NvmlClocks(uuid=UUIDS[1])
    assert clocks.supported_clocks()  # reading is allowed
    for call in (lambda: clocks.set(1200), clocks.reset):
        with pytest.raises(ClocksOffError, match="KAREUS_CLOCKS"):
            call()
    monkeypatch.setattr("kareus.runtime.clocks.ZeusClocks", _NoZeus)
    dry = default_controller()  # this process's GPU, read through NVML, set by nobody
    assert isinstance(dry, DryRunClocks) and "KAREUS_CLOCKS" in dry.why
    dry.set(1200)
    assert calls == [] and nvml.locked == {}


class _NoZeus:
    def __init__(self, *a, **k):
        raise ClockError("no Zeus in this test")


def test_kareus_clocks_off_keeps_doctor_runtime_and_recovery_from_the_gpu(
    monkeypatch, nvml, tmp_path
):
    from kareus.jobs.doctor import diagnose, try_switches
    from kareus.runtime.switcher import ClockRuntime, Step

    monkeypatch.setenv("KAREUS_CLOCKS", "off")
    report = diagnose()
    assert not report.may_lock and "KAREUS_CLOCKS=off" in report.why
    assert "clock changes by kareus: off" in report.to_text()
    switches = try_switches(report, settle_s=0.01)  # asked anyway: every GPU says why not
    assert all("KAREUS_CLOCKS" in sw["error"] for sw in switches.values()), switches
    with pytest.warns(RuntimeWarning, match="KAREUS_CLOCKS=off forbids"):
        runtime = ClockRuntime([Step("forward", 1200)], NvmlClocks(uuid=UUIDS[0]))
        runtime.switch(0, "forward")
    assert not runtime.enabled and "clocks NOT applied" in runtime.to_text()
    runtime.close()
    nvml.locked[UUIDS[2]] = 1200  # left by a killed run: kareus under off does not reset it
    _dead_lock(tmp_path / "journal", gpu=2, uuid=UUIDS[2], controller="nvml")
    (message,) = journal.recover(tmp_path / "journal")
    assert "KAREUS_CLOCKS" in message and "nvidia-smi -rgc -i GPU-cccc" in message, message
    assert nvml.locked == {UUIDS[2]: 1200}


def test_the_suite_runs_with_clocks_off_and_real_nvml_setters_refused():
    import conftest
    import pynvml

    assert os.environ["KAREUS_CLOCKS"] == "off"  # and the processes tests start inherit it
    before = len(conftest.REAL_SETTER_CALLS)
    with pytest.raises(conftest.RealSetterCalled):
        pynvml.nvmlDeviceSetGpuLockedClocks(None, 1485, 1485)
    assert conftest.REAL_SETTER_CALLS[before:] == ["nvmlDeviceSetGpuLockedClocks"]
    del conftest.REAL_SETTER_CALLS[before:]  # (this one was on purpose)


def test_emulated_clocks_switch_as_the_host_reaches_them_on_a_cuda_machine(monkeypatch):
    """On a machine whose CUDA is initialised (another test used it), a controller of no GPU
    is set at once; one of a GPU waits on a CUDA event (faked here) in the worker."""
    from kareus.runtime.clocks import EmulatedClocks
    from kareus.runtime.switcher import ClockRuntime, Step

    events = []

    class Event:
        def __init__(self, blocking=False):
            events.append(self)

        def record(self):
            pass

        def synchronize(self):
            pass

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    emulated = EmulatedClocks()
    runtime = ClockRuntime([Step("forward", 1200)], emulated)
    runtime.switch(0, "forward")
    assert emulated.current == 1200 and events == []
    runtime.close()

    class OnTheGpu(EmulatedClocks):
        waits_for_gpu = True

    gpu = OnTheGpu()
    runtime = ClockRuntime([Step("forward", 1100)], gpu)
    runtime.switch(0, "forward")
    runtime.close()  # lets the worker apply what it queued
    assert len(events) == 1 and runtime.switches == [1100]


def test_compile_time_planning_plans_only_for_regions_on_the_gpu(monkeypatch):
    """A GPU in the machine is no reason to plan clocks for a model that runs on the CPU."""
    import kareus
    from kareus.compiler import apply_plan
    from kareus.models import PRESETS, Llama

    monkeypatch.setattr(apply_plan, "this_gpu", lambda: "A100-SXM4-40GB")
    model = kareus.compile(Llama(PRESETS["tiny"]))
    ids = torch.randint(0, 128, (4, 16))
    model(ids, ids).backward()
    report = kareus.explain(model)
    assert kareus.compiler.backend.find_backend(model).runtime is None
    assert "no clock plan: the region runs on cpu" in report.summary()
