"""Pure planning: which ranks form each role's groups, the plan's fingerprint, mesh shapes and the
communicator memory estimate. Nothing here imports torch.distributed.
"""
