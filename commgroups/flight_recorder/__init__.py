"""The always-on flight recorder: per-role ring buffers of issued collectives, the store-published
status that names who is behind when a role times out, and the dumps and their merge.

Everything the recorder is lives here; the rest of commgroups holds only small hooks
(:class:`~commgroups.collectives.role_collectives.RoleCollectives` records its calls, a
:class:`~commgroups.generation.Generation` opens and closes a :class:`FlightRecorder`).
"""

from __future__ import annotations

from commgroups.flight_recorder.entries import FlightEntry
from commgroups.flight_recorder.recorder import FlightRecorder, RoleRecorder
from commgroups.flight_recorder.settings import ENV_VAR, flight_enabled
from commgroups.flight_recorder.signals import dump_on_signal

__all__ = ["ENV_VAR", "FlightEntry", "FlightRecorder", "RoleRecorder", "dump_on_signal",
           "flight_enabled"]
