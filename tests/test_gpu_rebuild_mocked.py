"""The GPU/NPU paths of rebuild() on the CPU: NCCL abort, the shrink capability, HCCL abort.

NCCL and HCCL cannot run here, so each test mocks only the NCCL/HCCL piece, and says so in its
name: the c10d call that aborts (``_abort_process_group``), a group's NCCL backend (a fake of the
real ProcessGroupNCCL / ProcessGroupNCCL2 of a recorded CUDA build, with exactly its attributes:
``tests/nccl_fakes.py``), or whether the default group is bound to an NCCL device. Everything
else (adapters, the registry's retire and refusal paths, commgroups' torch_internals) is the real
code. What these do not show, the GPU check runs on one GPU (``tests/test_gpu_rebuild.py``):
a real one-rank NCCL abort during a rebuild and the machine's real shrink answer.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist

import commgroups as cg
from commgroups import registry as registry_module
from commgroups import torch_internals
from commgroups.backends.gloo import GlooAdapter
from commgroups.backends.hccl import HcclAdapter
from commgroups.backends.nccl import NcclAdapter
from commgroups.backends.rccl import RcclAdapter
from commgroups.creation.role_groups import CreatedRole, CreationContext
from commgroups.errors import RebuildError
from commgroups.generation import Generation, GenerationRequest
from commgroups.registry import RegistryState
from tests import nccl_fakes, torch_private

BOUND_NCCL = CreationContext(default_backend="nccl", device_bound=True, accelerator=True)


def _aborts_recorded(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Replace c10d's abort (NCCL/HCCL only) with a recorder; returns what it was called with."""
    calls: list[Any] = []
    monkeypatch.setattr(*torch_private.abort_target(), calls.append)
    return calls


def _backend_answers(monkeypatch: pytest.MonkeyPatch, answer: bool | None,
                     nccl_class: tuple[str, str] = ("2.15.0", "ProcessGroupNCCL2")) -> list[Any]:
    """Make every group's backend a fake NCCL backend (``nccl_class``: version and class as
    recorded) answering ``supports_shrinking`` with ``answer``; None: the group has no backend for
    the device (torch's RuntimeError), so the answer is unknown. Returns the devices asked for."""
    version, name = nccl_class

    def backend_for(group: Any, device: torch.device) -> Any:
        if answer is None:
            raise RuntimeError(f"No backend type associated with device type {device}")
        return nccl_fakes.fake_backend(version, name, supports_shrinking=answer)

    return nccl_fakes.serve_backends(monkeypatch, backend_for)


# ------------------------------------------------------------------------------ capability flags
def test_capability_flags() -> None:
    assert NcclAdapter.aborts and RcclAdapter.aborts and HcclAdapter.aborts
    assert not GlooAdapter.aborts  # gloo's abort frees no blocked collective: left referenced
    assert NcclAdapter.supports_split and not HcclAdapter.supports_split


@pytest.mark.parametrize("nccl_class", nccl_fakes.nccl_backends())
def test_shrink_needs_torch_shrink_group_and_the_backend_mocked_nccl(
        monkeypatch: pytest.MonkeyPatch, nccl_class: tuple[str, str]) -> None:
    group = nccl_fakes.fake_group(bound_device_id=torch.device("cuda", 3))
    asked = _backend_answers(monkeypatch, True, nccl_class)
    assert NcclAdapter().shrink_blocker(group) is None and NcclAdapter().shrinks(group)
    assert asked[0] == torch.device("cuda", 3)  # the bound device, as torch's shrink_group reads it

    _backend_answers(monkeypatch, False, nccl_class)
    blocker = NcclAdapter().shrink_blocker(group)
    assert blocker is not None and "supports_shrinking=False" in blocker and "2.27" in blocker

    asked = _backend_answers(monkeypatch, None, nccl_class)
    unbound = nccl_fakes.fake_group(bound_device_id=None)
    blocker = NcclAdapter().shrink_blocker(unbound)
    assert blocker is not None and "cannot tell" in blocker and asked == [torch.device("cuda")]

    _backend_answers(monkeypatch, True, nccl_class)
    monkeypatch.delattr(dist, "shrink_group")
    blocker = NcclAdapter().shrink_blocker(group)
    assert blocker is not None and "no torch.distributed.shrink_group" in blocker


def test_gloo_and_hccl_never_shrink() -> None:
    for adapter in (GlooAdapter(), HcclAdapter()):
        blocker = adapter.shrink_blocker(object())
        assert blocker is not None and adapter.name in blocker and not adapter.shrinks(object())


@pytest.mark.parametrize("nccl_class", nccl_fakes.nccl_backends())
def test_backend_supports_shrinking_reads_the_backend_property_mocked_nccl(
        monkeypatch: pytest.MonkeyPatch, nccl_class: tuple[str, str]) -> None:
    version, name = nccl_class
    backends: dict[Any, Any] = {}
    nccl_fakes.serve_backends(monkeypatch, lambda group, device: backends[group])
    check = torch_internals.backend_supports_shrinking
    cuda = torch.device("cuda")
    yes, no, unknown, missing = (nccl_fakes.fake_group() for _ in range(4))
    backends[yes] = nccl_fakes.fake_backend(version, name, supports_shrinking=True)
    backends[no] = nccl_fakes.fake_backend(version, name, supports_shrinking=False)
    backends[unknown] = nccl_fakes.fake_backend(version, name)  # a property that fails when read
    assert check(yes, cuda) is True and check(no, cuda) is False
    assert check(unknown, cuda) is None
    assert check(missing, cuda) is None  # no backend for the device (KeyError here)


def test_backend_supports_shrinking_without_the_property_mocked_nccl(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend object without supports_shrinking (a fake of the recorded ProcessGroup, which has
    no such property): unknown, never an AttributeError."""
    bare = nccl_fakes.fake_class("ProcessGroup", "2.10.0")()  # ProcessGroup has no such property
    nccl_fakes.serve_backends(monkeypatch, lambda group, device: bare)
    assert "supports_shrinking" not in nccl_fakes.recorded("2.10.0", "ProcessGroup")  # type: ignore[operator]
    assert torch_internals.backend_supports_shrinking(object(), torch.device("cuda")) is None  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------- aborts
def test_nccl_abort_goes_through_c10d_mocked_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _aborts_recorded(monkeypatch)
    group = object()
    NcclAdapter().abort(group)
    assert calls == [group]


def test_hccl_abort_goes_through_c10d_without_torch_npu_mocked_hccl(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _aborts_recorded(monkeypatch)
    group = object()
    HcclAdapter().abort(group)
    assert calls == [group]
    assert "torch_npu" not in sys.modules  # aborting imports nothing of torch_npu


def test_a_failing_abort_is_logged_not_raised_mocked_nccl(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def refuse(group: Any) -> None:
        raise RuntimeError("NCCL communicator was aborted already")

    monkeypatch.setattr(*torch_private.abort_target(), refuse)
    NcclAdapter().abort(object())
    assert "aborting" in caplog.text and "aborted already" in caplog.text


def _registry(roles: dict[str, CreatedRole], layout: cg.Layout | None = None) -> cg.GroupRegistry:
    """A registry in the state create() leaves on rank 0 of 2, holding ``roles`` (no torch world)."""
    registry = cg.GroupRegistry(layout or cg.Layout(dims={"tp": 2}))
    registry._rank = registry._recovery.rank = 0
    request = GenerationRequest(number=0, layout=registry.layout, plan=registry.plan, rank=0,
                                mode="auto", create_timeout_s=300.0,
                                context=CreationContext(default_backend="gloo", device_bound=False))
    registry._current = Generation(request=request, roles=roles)
    registry._state = RegistryState.CREATED
    return registry


def test_retire_aborts_nccl_and_hccl_groups_and_leaves_gloo_mocked_nccl_hccl(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _aborts_recorded(monkeypatch)
    nccl, hccl, gloo = object(), object(), object()
    registry = _registry({
        "tp": CreatedRole(nccl, "all_ranks", NcclAdapter(), [nccl]),  # type: ignore[arg-type]
        "npu": CreatedRole(hccl, "all_ranks", HcclAdapter(), [hccl]),  # type: ignore[arg-type]
        "checkpoint-metadata": CreatedRole(gloo, "local", GlooAdapter(), [gloo]),  # type: ignore[arg-type]
    })
    registry._retire()
    assert calls == [nccl, hccl]  # gloo: kept referenced, never aborted nor destroyed
    assert registry._state == "retired"
    assert [r.group for r in registry._recovery.retired[-1].roles.values()] == [nccl, hccl, gloo]


# ------------------------------------------------------------------------ bound default group
def _bound_split_registry(monkeypatch: pytest.MonkeyPatch) -> cg.GroupRegistry:
    """A registry whose tp role was split from a device-bound NCCL default group (mocked)."""
    monkeypatch.setattr(registry_module.CreationContext, "detect", classmethod(
        lambda cls: BOUND_NCCL))
    monkeypatch.setattr(torch_internals, "default_group",
                        lambda: nccl_fakes.fake_group(bound_device_id=torch.device("cuda", 0)))
    split = object()
    return _registry({"tp": CreatedRole(split, "split", NcclAdapter(), [split])})  # type: ignore[arg-type]


def test_bound_rebuild_names_the_missing_shrink_capability_mocked_nccl(
        monkeypatch: pytest.MonkeyPatch) -> None:
    registry = _bound_split_registry(monkeypatch)
    _backend_answers(monkeypatch, False)
    calls = _aborts_recorded(monkeypatch)
    with pytest.raises(RebuildError) as caught:
        registry.rebuild(alive=[0])
    message = str(caught.value)
    assert "role 'tp'" in message and "ncclCommSplit" in message
    assert "needs shrink_group, which this job lacks" in message
    assert "supports_shrinking=False" in message and "NCCL >= 2.27" in message
    assert "without device_id" in message and "restart mode" in message
    # Refused before the check-in: nothing retired, nothing aborted, the registry still usable.
    assert registry._state == "created" and calls == []


def test_bound_rebuild_without_a_world_role_names_the_fix_mocked_nccl(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """This torch and NCCL can shrink, but no device role spans the world: refused, nothing
    shrunk (least of all the default group), the message naming the role to add."""
    monkeypatch.setattr(registry_module.CreationContext, "detect", classmethod(
        lambda cls: BOUND_NCCL))
    default = nccl_fakes.fake_group(bound_device_id=torch.device("cuda", 0))
    monkeypatch.setattr(torch_internals, "default_group", lambda: default)
    asked = _backend_answers(monkeypatch, True)
    calls = _aborts_recorded(monkeypatch)
    shrunk: list[Any] = []
    monkeypatch.setattr(dist, "shrink_group", lambda *a, **k: shrunk.append((a, k)))
    cp, dpr = object(), object()
    registry = _registry({
        "cp": CreatedRole(cp, "split", NcclAdapter(), [cp]),  # type: ignore[arg-type]
        "dp_replicate": CreatedRole(dpr, "split", NcclAdapter(), [dpr]),  # type: ignore[arg-type]
    }, cg.Layout(
        dims={"dp_replicate": 2, "cp": 2}, elastic={"dims": {"dp_replicate": 1}},
        roles=[cg.RoleSpec(name="cp", dims=["cp"]),
               cg.RoleSpec(name="dp_replicate", dims=["dp_replicate"])]))
    with pytest.raises(RebuildError) as caught:
        registry.rebuild(alive=[0, 1])
    message = str(caught.value)
    assert "role 'cp'" in message and "can shrink" in message
    assert "no role here spans the world on nccl" in message
    assert "cg.RoleSpec(name='world', dims='world')" in message
    assert "renumbering every rank" in message  # why the default group is not shrunk instead
    assert "restart mode" in message and "without device_id" in message
    assert asked == [torch.device("cuda", 0)]  # the capability was asked of the default group
    assert shrunk == [] and calls == [] and registry._state == "created"


def test_unbound_nccl_is_not_refused_mocked_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry_module.CreationContext, "detect", classmethod(
        lambda cls: CreationContext(default_backend="nccl", device_bound=False, accelerator=True)))
    group = object()
    registry = _registry({"tp": CreatedRole(group, "local", NcclAdapter(), [group])})  # type: ignore[arg-type]
    registry._recovery.check_rebuildable(registry._current)
    # no refusal above: new groups need no split of the default group
