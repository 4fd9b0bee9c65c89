"""The GPU check: streams, communicator memory, async-and-wait cost and creation time on one NVIDIA GPU.

Run by ``scripts/gpu-check`` (``make gpu-check``) as ``python -m commgroups.bench.gpu run``; see
benchmarks/README.md ("GPU check"). Collection needs a CUDA device and runs each part in its own
process (:mod:`~commgroups.bench.gpu.orchestrate`, :mod:`~commgroups.bench.gpu.worker`):
:mod:`~commgroups.bench.gpu.streams`, :mod:`~commgroups.bench.gpu.memory_probe`,
:mod:`~commgroups.bench.gpu.async_wait_cost`, :mod:`~commgroups.bench.gpu.creation_time`. Analysis is
pure and imports no torch (:mod:`~commgroups.bench.gpu.trace`, :mod:`~commgroups.bench.gpu.analysis`,
:mod:`~commgroups.bench.gpu.report`, :mod:`~commgroups.bench.gpu.outputs`), so committed results can
be re-analysed anywhere (``python -m commgroups.bench.gpu analyze DIR``).
"""
