"""Test support for running stock torchtitan and torchtitan through commgroups on CPU gloo ranks.

Not shipped in the package: CPU patches (torchtitan targets accelerators), test assets made at test
time (the torchtitan wheel ships no tokenizer or data set and CI is offline), and a rank function
that trains one configuration and reports losses, default-group collective counts and mesh facts.
"""
