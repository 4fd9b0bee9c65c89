"""commgroups' tests. A package so spawned ranks can import test helpers by name."""
