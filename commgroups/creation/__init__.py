"""Making communicators: the ranks' agreement before creation, how each role's group is created,
the store namespaces they meet in, and DeviceMeshes over the groups made.
"""
