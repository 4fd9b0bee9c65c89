"""How big each benchmark run is: the full run, ``--quick`` and the smoke test's smallest run."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BenchConfig", "full_config", "quick_config", "smoke_config"]

KiB = 1024
MiB = 1024 * KiB


@dataclass(frozen=True)
class BenchConfig:
    """Sizes and repetition counts of every scenario; repetitions are interleaved across variants."""

    name: str
    gloo_worlds: tuple[int, ...]
    """Real gloo worlds (4 and 8 ranks) for creation and checkpoint metadata."""
    creation_repetitions: int
    """Fresh gloo worlds per size, each creating every variant once (even: the order is
    counterbalanced over pairs of repetitions, :func:`~commgroups.bench.stats.interleaved`)."""
    first_creation_repetitions: int
    """Fresh worlds per gloo world size and variant for the first creation in a process."""
    fake_worlds: tuple[int, ...]
    """Simulated worlds (fake backend, one process) for creation at scale."""
    fake_repetitions: int
    plan_worlds: tuple[int, ...]
    plan_repetitions: int
    async_and_wait_sizes: tuple[int, ...]
    """Message sizes in bytes for the async-and-wait overhead."""
    async_and_wait_ops: tuple[str, ...]
    async_and_wait_repetitions: int
    async_and_wait_target_s: float
    """Each timed block runs enough calls to take about this long (fewer timer reads per call)."""
    dcp_repetitions: int
    dcp_tensors: int
    dcp_tensor_bytes: int
    metadata_items: tuple[int, ...]
    """WriteItems per SavePlan in the metadata exchange."""
    metadata_repetitions: int
    audit_repetitions: int = 9
    """Blocks per variant of the audit's cost (a debug tool's cost: tens of percent, not 2%)."""
    rebuild_repetitions: int = 3
    """Rebuilds after a rank loss in the largest fake world."""
    kill_repetitions: int = 2
    """Kill-to-rebuilt worlds per gloo world size and variant (one fresh world each)."""
    rebuild_cycles: int = 10
    """Lone rebuilds (nobody lost) whose leftovers the resource count measures (smallest world)."""
    timeout_s: float = 600.0
    control_plane_sizes: tuple[int, ...] = (1024, 8192, 65536)
    """Simulated ranks of the control-plane scenario (many per process, one real TCPStore)."""
    control_plane_idle_ranks: int = 128
    """Ranks whose idle phase runs a real listener and beat each (a socket and two threads)."""
    control_plane_idle_s: float = 10.0


def full_config() -> BenchConfig:
    """The full run (about ten minutes on 2 cores; not part of CI)."""
    return BenchConfig(
        name="full",
        gloo_worlds=(4, 8),
        creation_repetitions=16,
        first_creation_repetitions=10,
        fake_worlds=(1024, 8192, 65536),
        fake_repetitions=7,
        plan_worlds=(1024, 8192, 65536, 262144, 1048576),
        plan_repetitions=15,
        async_and_wait_sizes=(4, 256, 4 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB),
        async_and_wait_ops=("all_reduce", "all_gather_into_tensor"),
        async_and_wait_repetitions=21,
        async_and_wait_target_s=0.05,
        dcp_repetitions=9,
        dcp_tensors=16,
        dcp_tensor_bytes=256 * KiB,
        metadata_items=(10, 100, 1000, 3000),
        metadata_repetitions=9,
        audit_repetitions=21,
        rebuild_repetitions=7,
        kill_repetitions=5,
        control_plane_idle_ranks=1024,
    )


def quick_config() -> BenchConfig:
    """``--quick``: every scenario and world, fewer sizes and repetitions (under two minutes)."""
    return BenchConfig(
        name="quick",
        gloo_worlds=(4, 8),
        creation_repetitions=8,
        first_creation_repetitions=4,
        fake_worlds=(1024, 8192, 65536),
        fake_repetitions=3,
        # The 1,048,576-rank plan (2 s a repetition, DeviceMesh's side 1.2 s of it) is the full
        # run's: the quick run stays under two minutes with every scenario in it.
        plan_worlds=(1024, 65536),
        plan_repetitions=3,
        # The async-and-wait floor (1.02) is a 2% bound: it needs more calls per repetition than the
        # other scenarios to rise above a shared machine's noise. Only sizes from 64 KiB count
        # toward it: the 4-byte row is the full run's (7.5 s here).
        async_and_wait_sizes=(MiB, 16 * MiB),
        async_and_wait_ops=("all_reduce",),
        async_and_wait_repetitions=19,
        async_and_wait_target_s=0.15,
        dcp_repetitions=5,
        dcp_tensors=8,
        dcp_tensor_bytes=64 * KiB,
        metadata_items=(10, 100, 1000),
        metadata_repetitions=3,  # the 1,000-item exchange: 0.3-0.5 s each, both groups, 8 ranks
        audit_repetitions=3,
        # Each idle rank opens its own store connection, and on this machine's sandbox one in
        # about 25 stalls the server for 5 s: 128 ranks took 20 s to connect. The idle figure
        # per rank does not depend on N (tests/test_control_plane_scale.py holds 128 to 1,024).
        control_plane_idle_ranks=32,
    )


def smoke_config() -> BenchConfig:
    """The smallest run of every scenario (the smoke test: seconds, numbers meaningless)."""
    return BenchConfig(
        name="smoke",
        gloo_worlds=(4,),
        creation_repetitions=1,
        first_creation_repetitions=1,
        fake_worlds=(64,),
        fake_repetitions=1,
        plan_worlds=(1024,),
        plan_repetitions=1,
        async_and_wait_sizes=(4, 64 * KiB),
        async_and_wait_ops=("all_reduce",),
        async_and_wait_repetitions=2,
        async_and_wait_target_s=0.001,
        dcp_repetitions=1,
        dcp_tensors=2,
        dcp_tensor_bytes=KiB,
        metadata_items=(10,),
        metadata_repetitions=1,
        audit_repetitions=1,
        rebuild_repetitions=1,
        kill_repetitions=1,
        rebuild_cycles=2,
        timeout_s=240.0,
        control_plane_sizes=(64,),
        control_plane_idle_ranks=8,
        control_plane_idle_s=1.0,
    )
