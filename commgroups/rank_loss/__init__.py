"""Surviving a rank loss, in one place: the entry point the registry calls
(:class:`~commgroups.rank_loss.recovery.Recovery`), the heartbeat and loss reports
(:mod:`~commgroups.rank_loss.liveness`), a dead process confirmed by its host
(:mod:`~commgroups.rank_loss.local_peers`), the survivors' check-in
(:mod:`~commgroups.rank_loss.check_in`), the smaller layout (:mod:`~commgroups.rank_loss.replan`)
and the rebuild's report.

It sits above :mod:`commgroups.generation`: it retires a generation and makes the next through
:func:`~commgroups.generation.make_generation`; nothing it imports imports it back. What a rebuild
needs below that line (severing gloo sockets, the NCCL shrink spine) is creation's
(:mod:`commgroups.creation.sockets`, :mod:`commgroups.creation.shrink`).
"""

from commgroups.rank_loss.rebuild_report import RebuildReport
from commgroups.rank_loss.recovery import Recovery

__all__ = ["RebuildReport", "Recovery"]
