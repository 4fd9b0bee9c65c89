"""Making communicators: the ranks' agreement before creation, how each role's group is created,
the store namespaces they meet in, DeviceMeshes over the groups made, the sockets a gloo group
opened (severed to interrupt it) and the NCCL spine a rebuild on a bound default group splits from.
"""
