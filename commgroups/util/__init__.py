"""Small helpers shared by several concepts: text tables, call sites, local process worlds.
Nothing here knows roles or registries.
"""
