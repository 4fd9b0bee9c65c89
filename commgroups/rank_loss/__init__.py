"""Surviving a rank loss: the survivors' check-in, the smaller layout (replan), the NCCL shrink
spine and the rebuild's report.
"""
