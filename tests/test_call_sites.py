"""commgroups.util.call_sites: a record's caller is the first frame outside the plumbing modules."""

from __future__ import annotations

from importlib.util import find_spec
from typing import Any

from commgroups.util.call_sites import PLUMBING_MODULES, call_site, is_plumbing


# ------------------------------------------------------------------------ the call-site rule
def _frame_chain(modules: list[str]) -> str:
    """call_site() seen through one function per module name, outermost first.

    Each function is compiled with its module's name in its globals and a file name derived from
    it, the way an imported module's frames carry them.
    """
    below: Any = call_site
    for module in reversed(modules):
        namespace: dict[str, Any] = {"__name__": module, "below": below}
        exec(compile("def hop():\n    return below()\n", f"/src/{module.replace('.', '/')}.py",
                     "exec"), namespace)
        below = namespace["hop"]
    result: str = below()
    return result


def test_call_site_is_the_first_frame_outside_the_plumbing() -> None:
    chain = ["torchtitan.train", "commgroups.integrations.fsdp", "torch.distributed.fsdp",
             "typing_extensions", "torch.distributed.distributed_c10d", "commgroups.audit.recorder"]
    assert _frame_chain(chain) == "/src/torchtitan/train.py:2 in hop"
    # an application built on commgroups is a caller like any other: no special case for the demo
    assert _frame_chain(["commgroups.demo.train", "commgroups.collectives.role_collectives",
                         "torch.distributed"]
                        ).startswith("/src/commgroups/demo/train.py:")
    assert _frame_chain(["spmd_types._collectives", "torch.distributed"]).startswith(
        "/src/spmd_types/_collectives.py:")
    # with nothing but plumbing inside, the test itself is the caller
    assert _frame_chain(["torch.x", "commgroups.registry"]).startswith(__file__)


def test_is_plumbing_matches_whole_module_prefixes() -> None:
    assert is_plumbing("torch") and is_plumbing("torch.distributed.tensor._redistribute")
    assert is_plumbing("commgroups.backends.nccl") and is_plumbing("commgroups.audit.recorder")
    assert not is_plumbing("torchtitan.train")  # a prefix of the name, not of the module path
    assert not is_plumbing("commgroups.demo.train") and not is_plumbing("commgroups.bench.run")
    assert not is_plumbing("__main__")
    assert is_plumbing("mylib.wrappers", ("mylib",))


def test_every_plumbing_prefix_names_an_existing_module() -> None:
    # a module renamed or removed on main must be renamed here too, or its frames become callers
    missing = [prefix for prefix in PLUMBING_MODULES if find_spec(prefix) is None]
    assert missing == []


def test_module_of_takes_the_longest_import_root() -> None:
    from commgroups.util.call_sites import module_of

    roots = ["/venv/lib", "/venv/lib/site-packages"]
    assert module_of("/venv/lib/site-packages/torch/distributed/__init__.py", roots) == "torch.distributed"
    assert module_of("/venv/lib/json/decoder.py", roots) == "json.decoder"
    assert module_of("/elsewhere/train.py", roots) is None
    assert module_of("/venv/lib/site-packages/ext.so", roots) is None


def test_call_site_of_recorded_frames_walks_past_torch_and_commgroups() -> None:
    import torch

    import commgroups
    from commgroups.util.call_sites import call_site_of

    torch_file = torch.distributed.distributed_c10d.__file__
    ours = commgroups.collectives.async_wait.__file__
    frames = [{"name": "all_reduce", "filename": torch_file, "line": 3245},
              {"name": "issue_and_wait", "filename": ours, "line": 10},
              {"name": "step", "filename": "/job/train.py", "line": 12}]
    assert call_site_of(frames) == "/job/train.py:12 in step"
    assert call_site_of(frames[:2]) == "<unknown>"
    # a torch file no import root holds (a build tree) is still plumbing
    assert call_site_of([{"name": "f", "filename": "/build/torch/x.py", "line": 1}, *frames[2:]]) \
        == "/job/train.py:12 in step"
