"""The demo's settings, and the layout it runs on (the seed's by default)."""

from __future__ import annotations

from dataclasses import dataclass

from commgroups.layout.specs import CHECKPOINT_ROLE, Layout, RoleSpec

__all__ = ["BASELINES", "DemoConfig", "seed_layout"]

BASELINES = ("devicemesh",)


@dataclass(frozen=True)
class DemoConfig:
    """Everything one demo run needs; identical on every rank."""

    world_size: int = 4
    steps: int = 5
    layout_path: str | None = None
    baseline: str | None = None
    batch: int = 4
    tokens_per_cp_rank: int = 8
    lr: float = 1e-2
    json_path: str | None = None
    checkpoint_dir: str | None = None
    timeout_s: float = 120.0
    audit: bool = True
    quiet: bool = False

    @property
    def mode(self) -> str:
        """``registry`` (commgroups) or the baseline's name."""
        return self.baseline or "registry"


def seed_layout(world_size: int) -> Layout:
    """The seed's layout for ``world_size`` ranks: dp_shard=1, cp spans the world.

    The same roles as ``examples/layouts/seed_cp4.toml``: fsdp over dp_shard x cp, a cp role on the
    device backend and the checkpoint-metadata role on gloo.
    """
    return Layout(
        dims={"dp_shard": 1, "cp": world_size},
        roles=[
            RoleSpec(name="fsdp", dims=["dp_shard", "cp"]),
            RoleSpec(name="cp", dims=["cp"], backend="device"),
            RoleSpec(name=CHECKPOINT_ROLE, dims="world", backend="gloo"),
        ],
    )
