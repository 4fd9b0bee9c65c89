"""Generations: one set of communicators made by one ``create()`` or ``rebuild()``.

:mod:`~commgroups.generation.make` makes one (agree, then create: the only code here that makes a
communicator); :mod:`~commgroups.generation.state` holds it (lookups that never create, and the
teardowns: interrupt, retire, release, destroy). The registry owns the current generation; the
rank-loss package (:mod:`commgroups.rank_loss`) makes the next one on the survivors.
"""

from commgroups.generation.make import make_generation
from commgroups.generation.state import (
    STORE_PREFIX,
    Generation,
    GenerationRequest,
    MeshAxis,
    dims_needing_groups,
)

__all__ = ["STORE_PREFIX", "Generation", "GenerationRequest", "MeshAxis", "dims_needing_groups",
           "make_generation"]
