"""RegistryParallelDims against torchtitan's own ParallelDims, case by case, on the same degrees.

The cases torchtitan's ParallelDims unit tests cover (written here afresh, none of its code): the
validation of degrees (a product that is not the world size, degrees below 1, ``dp_shard=-1``
taking the ranks left), the ``*_enabled`` and derived properties, ``from_config``, and, after
``build_mesh()``, every lookup: ``get_mesh`` / ``get_optional_mesh`` for every name (None for
size-1 dims exactly where stock gives None), multi-axis requests, ``get_all_one_dimensional_meshes``,
``get_activated_mesh``, ``resolve_mesh``, ``spmd_meshes``, sizes, dim names and ranks. Each is
asked of stock and of commgroups on one world (fake worlds up to 16,384 ranks, and one real
in-process gloo rank here; 2- and 4-rank gloo worlds in tests/test_torchtitan_parallel_dims_world.py)
and the answers must be equal (tests/titan/parallel_dims.py). Where commgroups differs on purpose
(the guide's torchtitan section: ``world_mesh``, the placeholder MoE view when ep == 1), the test
checks commgroups' documented behaviour instead. Skipped only when torchtitan is not installed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator

import pytest
import torch.distributed as dist

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                       reason="torchtitan is not installed (pip install 'commgroups[torchtitan]')"),
    pytest.mark.heavy,  # seconds a test: left out of make test-fast
]

# (imports no torchtitan itself: collected everywhere, skipped above without it)
from tests.titan.parallel_dims import BACKENDS, Degrees, built_pair, compare, stock_on_cpu  # noqa: E402

ENABLED = ("dp_enabled", "dp_replicate_enabled", "dp_shard_enabled", "cp_enabled",
           "dp_cp_enabled", "fsdp_enabled", "tp_enabled", "pp_enabled", "ep_enabled")
DERIVED = ("non_data_parallel_size", "seq_len_divisor")


def _pair(kwargs: dict[str, object]) -> tuple[object, object]:
    """Stock ParallelDims and RegistryParallelDims (no registry: nothing is built) from ``kwargs``."""
    from commgroups.integrations.torchtitan.parallel_dims import RegistryParallelDims
    from commgroups.integrations.torchtitan.titan_internals import ParallelDims

    return ParallelDims(**kwargs), RegistryParallelDims(**kwargs)


# ---------------------------------------------------------------------------------- validation
# (degrees, world size, the properties stock answers, hand-checked so the comparison is not vacuous)
PROPERTY_CASES = [
    (Degrees(dp_replicate=2, dp_shard=2, tp=2), 8,
     {"dp_enabled", "dp_replicate_enabled", "dp_shard_enabled", "dp_cp_enabled", "fsdp_enabled",
      "tp_enabled"}, (2, 4)),
    (Degrees(cp=2), 2, {"cp_enabled", "dp_cp_enabled", "fsdp_enabled"}, (2, 4)),
    # ep does not count in the world size
    (Degrees(dp_shard=2, ep=2), 2,
     {"dp_enabled", "dp_shard_enabled", "dp_cp_enabled", "fsdp_enabled", "ep_enabled"}, (1, 2)),
    (Degrees(pp=2), 2, {"pp_enabled"}, (2, 2)),
    (Degrees(pp=2, dp_replicate=2, dp_shard=2, cp=2, tp=3), 48, None, (12, 12)),
    (Degrees(dp_replicate=2, cp=2, tp=4), 16, None, (8, 16)),
    (Degrees(dp_replicate=2, dp_shard=2, ep=3), 4, None, (1, 2)),
    (Degrees(), 1, set(), (1, 2)),
]


@pytest.mark.parametrize(("degrees", "world", "enabled", "derived"), PROPERTY_CASES,
                         ids=lambda v: str(v) if isinstance(v, Degrees) else None)
@pytest.mark.parametrize("backend", BACKENDS)
def test_degrees_and_properties_equal_stock(degrees: Degrees, world: int,
                                            enabled: set[str] | None,
                                            derived: tuple[int, int], backend: str) -> None:
    stock, ours = _pair(degrees.kwargs(world, backend))
    for field in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "world_size",
                  "spmd_backend"):
        assert getattr(ours, field) == getattr(stock, field), field
    for name in ENABLED + DERIVED:
        assert getattr(ours, name) == getattr(stock, name), name
    if enabled is not None:
        assert {name for name in ENABLED if getattr(ours, name)} == enabled
    assert (ours.non_data_parallel_size, ours.seq_len_divisor) == derived


@pytest.mark.parametrize(("dp_replicate", "tp", "world", "dp_shard"), [
    (2, 2, 8, 2), (1, 1, 8, 8), (1, 4, 4, 1), (2, 1, 16_384, 8192)])
def test_dp_shard_minus_one_takes_the_ranks_left(dp_replicate: int, tp: int, world: int,
                                                  dp_shard: int) -> None:
    stock, ours = _pair(Degrees(dp_replicate=dp_replicate, dp_shard=-1, tp=tp)
                        .kwargs(world, "partial_dtensor"))
    assert ours.dp_shard == stock.dp_shard == dp_shard  # type: ignore[attr-defined]


def test_from_config_resolves_as_stock() -> None:
    from torchtitan.config.configs import ParallelismConfig

    from commgroups.integrations.torchtitan.parallel_dims import RegistryParallelDims
    from commgroups.integrations.torchtitan.titan_internals import ParallelDims

    config = ParallelismConfig(data_parallel_replicate_degree=2, data_parallel_shard_degree=-1,
                               context_parallel_degree=1, tensor_parallel_degree=2,
                               pipeline_parallel_degree=1, expert_parallel_degree=1,
                               spmd_backend="full_dtensor")
    stock = ParallelDims.from_config(config, world_size=8)
    ours = RegistryParallelDims.from_config(config, world_size=8)
    assert type(ours) is RegistryParallelDims and ours.registry is None
    for field in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "world_size",
                  "spmd_backend"):
        assert getattr(ours, field) == getattr(stock, field), field
    assert (ours.dp_shard, ours.spmd_backend) == (2, "full_dtensor")


@pytest.mark.parametrize("kwargs", [
    {"dp_replicate": 2, "dp_shard": 2, "tp": 2, "world_size": 10},  # product 8, world 10
    {"dp_shard": 4, "cp": 2, "world_size": 4},
    {"dp_replicate": 0, "world_size": 1},
    {"cp": 0, "world_size": 1},
    {"tp": 0, "world_size": 1},
    {"pp": 0, "world_size": 1},
    {"ep": 0, "world_size": 1},
    {"dp_shard": 0, "world_size": 1},
    {"dp_shard": -2, "world_size": 1},
    {"dp_shard": -1, "tp": 4, "world_size": 6},  # 6 // 4 = 1 left, 4 != 6
    {"dp_shard": -1, "tp": 8, "world_size": 4},  # nothing left for dp_shard
], ids=lambda kwargs: "-".join(f"{k}{v}" for k, v in kwargs.items()))
def test_invalid_degrees_raise_as_stock(kwargs: dict[str, int]) -> None:
    """Stock asserts (AssertionError, its own text); commgroups' ParallelDims is stock's class
    underneath and raises the same, before any registry is involved."""
    full = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1, "ep": 1, **kwargs}
    with pytest.raises(AssertionError) as theirs:
        _pair({**full})
    from commgroups.integrations.torchtitan.parallel_dims import RegistryParallelDims

    with pytest.raises(AssertionError) as mine:
        RegistryParallelDims(**full)  # type: ignore[arg-type]
    assert str(mine.value) == str(theirs.value)


# ------------------------------------------------------------------------------ meshes, fake worlds
MESH_CASES = [
    # (degrees, world size, rank)
    (Degrees(), 1, 0),
    (Degrees(dp_replicate=2, dp_shard=2, tp=2), 8, 5),  # torchtitan's 8-rank case
    (Degrees(dp_replicate=2, dp_shard=-1, tp=2), 8, 7),
    (Degrees(dp_shard=2, cp=2), 4, 2),
    (Degrees(cp=4), 4, 3),  # cp = world: stock's cp is the default group
    (Degrees(pp=2, dp_shard=2, cp=2, tp=2), 16, 9),
    (Degrees(dp_shard=4, ep=2), 4, 1),
    (Degrees(dp_shard=2, tp=2, ep=2), 4, 3),
    (Degrees(pp=4, dp_replicate=2, dp_shard=64, cp=4, tp=4, ep=8), 8192, 0),
    (Degrees(pp=8, dp_replicate=2, dp_shard=64, cp=4, tp=4, ep=8), 16_384, 16_383),
]


@pytest.mark.parametrize(("degrees", "world", "rank"), MESH_CASES,
                         ids=lambda v: str(v) if isinstance(v, Degrees) else None)
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_lookup_equals_stock(fake_world: Callable[..., None], degrees: Degrees,
                                   world: int, rank: int, backend: str) -> None:
    fake_world(world, rank)
    with built_pair(degrees, world, backend) as (stock, ours, registry):
        assert compare(stock, ours, registry) == []
        # the loss mesh: stock's flatten name, on the loss role's group
        assert ours.get_optional_mesh("loss", include_singleton_axes=True).mesh_dim_names == (
            "loss_mesh",)


@pytest.fixture
def gloo_rank() -> Iterator[None]:
    """A real one-rank gloo world in this process (torchtitan's own single-rank cases)."""
    if dist.is_initialized():
        pytest.skip("another test left a default group initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_gloo_rank_equals_stock(gloo_rank: None, backend: str) -> None:
    """Every dim of size 1: every lookup None as stock's, no active mesh, a world of one."""
    with built_pair(Degrees(), 1, backend) as (stock, ours, registry):
        assert compare(stock, ours, registry) == []
        assert ours.get_all_one_dimensional_meshes() == {}
        assert ours.get_optional_mesh(["dp_replicate", "efsdp"]) is None
        assert ours.world_mesh.size() == 1
        for name in ("pp", "dp_replicate", "cp", "tp", "batch", "loss", "ep", "efsdp"):
            assert ours.get_optional_mesh(name) is None, name
        # size-1 dims cost no communicator (the guide: the single-rank backend, where stock uses
        # torch's fake backend)
        assert dist.get_backend(ours.get_mesh("fsdp" if backend == "partial_dtensor"
                                              else "dp_shard").get_group()) == "cg_single"


def test_lookups_build_the_meshes_on_first_use(fake_world: Callable[..., None]) -> None:
    """As stock, a lookup before ``build_mesh()`` builds; commgroups needs its registry for it."""
    import commgroups as cg
    from commgroups.errors import RegistryNotCreatedError
    from commgroups.integrations.torchtitan import TitanDegrees, titan_layout
    from commgroups.integrations.torchtitan.parallel_dims import RegistryParallelDims
    from commgroups.integrations.torchtitan.titan_internals import ParallelDims, single_axis_meshes

    fake_world(2, 1)
    with stock_on_cpu():
        stock = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=1, world_size=2)
        assert stock.get_optional_mesh("tp") is None and single_axis_meshes(stock)
    lone = RegistryParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=1, world_size=2)
    with pytest.raises(RegistryNotCreatedError, match=r"fix: set parallel_dims\.registry"):
        lone.get_optional_mesh("tp")
    degrees = TitanDegrees(pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=1, ep=1)
    with cg.GroupRegistry(titan_layout(degrees)) as registry:
        ours = RegistryParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=1,
                                    world_size=2, registry=registry)
        assert not single_axis_meshes(ours)
        assert ours.get_optional_mesh("tp") is None
        assert single_axis_meshes(ours).keys() == single_axis_meshes(stock).keys()
        assert ours.get_mesh("dp_shard").get_group() is registry.group("dp_shard")
