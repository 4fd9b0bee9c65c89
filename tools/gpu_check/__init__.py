"""The GPU check: streams, communicator memory, async-and-wait cost, creation time and a Megatron-Core
model on registry groups, on one NVIDIA GPU.

Run by ``scripts/gpu-check`` (``make gpu-check``) as ``python -m tools.gpu_check run``; see
benchmarks/README.md ("GPU check"). Collection needs a CUDA device and runs each part in its own
process (:mod:`~tools.gpu_check.orchestrate`, :mod:`~tools.gpu_check.worker`):
:mod:`~tools.gpu_check.streams`, :mod:`~tools.gpu_check.memory_probe`,
:mod:`~tools.gpu_check.async_wait_cost`, :mod:`~tools.gpu_check.creation_time`,
:mod:`~tools.gpu_check.megatron_model` (skipped without megatron-core). Analysis is
pure and imports no torch (:mod:`~tools.gpu_check.trace`, :mod:`~tools.gpu_check.analysis`,
:mod:`~tools.gpu_check.report`, :mod:`~tools.gpu_check.outputs`), so committed results can
be re-analysed anywhere (``python -m tools.gpu_check analyze DIR``).
"""
