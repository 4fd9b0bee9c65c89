"""backends/nccl.py and backends/rccl.py on the CPU: options, timeouts and availability, NCCL mocked.

``dist.ProcessGroupNCCL`` is replaced by a fake with exactly the attributes of the real class of a
recorded CUDA build (``tests/nccl_fakes.py``, from tests/data/nccl_class_attrs.json), so the
adapter can only set what torch's Options and config really have. The same Options class serves
ProcessGroupNCCL2 (torch 2.15's ``nccl``): ``tests/test_nccl_classes.py`` checks that in the record.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import commgroups as cg
from commgroups.backends.nccl import NcclAdapter
from commgroups.backends.rccl import RcclAdapter
from commgroups.errors import BackendUnavailableError
from tests import nccl_fakes

ALL_FIELDS = cg.NcclOptions(high_priority_stream=True, cga_cluster_size=2, min_ctas=1, max_ctas=8,
                            net_name="IB", split_share=True, blocking=False)


@pytest.mark.parametrize("version", [v for v, _ in nccl_fakes.nccl_backends("ProcessGroupNCCL")])
def test_make_options_sets_every_field_mocked_nccl(monkeypatch: pytest.MonkeyPatch,
                                                   version: str) -> None:
    monkeypatch.setattr(dist, "ProcessGroupNCCL", nccl_fakes.fake_class("ProcessGroupNCCL", version),
                        raising=False)
    adapter = NcclAdapter()
    options = adapter.make_options(cg.RoleOptions(nccl=ALL_FIELDS), timedelta(seconds=7))
    assert options is not None and options.is_high_priority_stream is True
    config = options.config
    assert (config.cga_cluster_size, config.min_ctas, config.max_ctas, config.net_name) == (
        2, 1, 8, "IB")
    assert config.split_share == 1 and config.blocking == 0  # ncclConfig_t takes ints
    assert type(config.split_share) is int
    again = adapter.make_options(cg.RoleOptions(nccl=ALL_FIELDS), timedelta(seconds=7))
    assert again is not options and again.config is not config  # new_group mutates: never shared


@pytest.mark.parametrize("version", [v for v, _ in nccl_fakes.nccl_backends("ProcessGroupNCCL")])
def test_group_args_carry_the_timeout_on_the_options_mocked_nccl(monkeypatch: pytest.MonkeyPatch,
                                                                 version: str) -> None:
    monkeypatch.setattr(dist, "ProcessGroupNCCL", nccl_fakes.fake_class("ProcessGroupNCCL", version),
                        raising=False)
    args = NcclAdapter().group_args(cg.RoleOptions(nccl=cg.NcclOptions(min_ctas=2)), 42.0)
    assert args.backend == "nccl" and args.timeout == timedelta(seconds=42)
    assert args.pg_options._timeout == timedelta(seconds=42)
    assert args.pg_options.is_high_priority_stream is False and args.pg_options.config.min_ctas == 2
    unset = args.pg_options.config.max_ctas  # never set: NCCL's own default stays
    assert isinstance(unset, nccl_fakes.Unset)


def test_no_nccl_section_means_no_options() -> None:
    assert NcclAdapter().make_options(cg.RoleOptions(), timedelta(seconds=1)) is None
    args = NcclAdapter().group_args(cg.RoleOptions(), None)
    assert args.pg_options is None and args.timeout == NcclAdapter().default_timeout()


def test_options_on_a_build_without_nccl_are_refused_mocked_nccl(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The 2.13.0 CPU leg as it is (and any CPU build): a clear refusal, not an AttributeError."""
    monkeypatch.delattr(dist, "ProcessGroupNCCL", raising=False)
    with pytest.raises(BackendUnavailableError, match=r"ProcessGroupNCCL\.Options"):
        NcclAdapter().make_options(cg.RoleOptions(nccl=ALL_FIELDS), timedelta(seconds=1))


def test_nccl_and_rccl_need_their_devices_here() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: NCCL is available here")
    for adapter in (NcclAdapter(), RcclAdapter()):
        with pytest.raises(BackendUnavailableError, match="fix:"):
            adapter.check_available()
    assert RcclAdapter.torch_backend == NcclAdapter.torch_backend == "nccl"
