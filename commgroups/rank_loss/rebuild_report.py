"""What :meth:`commgroups.GroupRegistry.rebuild` did on one rank: the new generation and its cost."""

from __future__ import annotations

from dataclasses import dataclass, field

from commgroups.layout.specs import Layout

__all__ = ["PHASES", "RebuildReport"]

PHASES: tuple[str, ...] = ("check_in", "replan", "retire", "create", "meshes", "release")
"""The phases of a rebuild, in order: agree on the survivors through the store, derive the smaller
layout and its rank map (:func:`commgroups.rank_loss.replan`), retire the old generation's groups, create
every role's group on the survivors, rebuild the meshes asked for, release the old generation (its
groups destroyed, its store keys deleted)."""


@dataclass(frozen=True)
class RebuildReport:
    """One rank's result of a rebuild (the same on every survivor but ``place`` and ``seconds``).

    Attributes:
        generation: the registry's generation now (1 after the first rebuild).
        layout: the layout of the new generation (elastic dims shrunk).
        members: ``members[new_rank]`` is the global rank holding that position now.
        lost: global ranks of the old generation that did not check in (or were not ``alive``).
        spares: survivors the new layout has no place for, kept as spares (``elastic.spares``).
        dropped: survivors the new layout has no place for, which should exit.
        place: this rank's part: ``member``, ``spare`` or ``dropped``.
        seconds: seconds per phase (:data:`PHASES`; phases that did not run are absent).
        retried: seconds of each earlier attempt of this ``rebuild()`` that a survivor's death
            ended (:class:`~commgroups.errors.SurvivorLostError`; it retried without them).
    """

    generation: int
    layout: Layout
    members: tuple[int, ...]
    lost: tuple[int, ...]
    spares: tuple[int, ...] = ()
    dropped: tuple[int, ...] = ()
    place: str = "member"
    seconds: dict[str, float] = field(default_factory=dict)
    retried: tuple[float, ...] = ()

    @property
    def total_seconds(self) -> float:
        """Seconds of the whole rebuild on this rank, attempts retried included."""
        return sum(self.seconds.values()) + sum(self.retried)

    def describe(self) -> str:
        """One readable paragraph: what was lost, what was rebuilt, and how long each phase took."""
        dims = " x ".join(f"{k}={v}" for k, v in self.layout.dims.items())
        phases = ", ".join(f"{name} {self.seconds[name] * 1e3:.0f} ms"
                           for name in PHASES if name in self.seconds)
        lines = [
            f"generation {self.generation}: lost ranks {list(self.lost)}; rebuilt on "
            f"{len(self.members)} ranks ({dims})",
            f"  this rank: {self.place}; phases: {phases} (total {self.total_seconds:.3f} s)",
        ]
        if self.retried:
            lines.append(f"  retried {len(self.retried)} time(s) after a survivor died "
                         f"({sum(self.retried):.3f} s)")
        if self.spares or self.dropped:
            lines.append(f"  spares {list(self.spares)}, dropped {list(self.dropped)}")
        return "\n".join(lines)
