"""Repository tooling: the GPU check (:mod:`tools.gpu_check`) and the torchtitan benchmark scenario
(:mod:`tools.titan_bench`). Run from the source tree; never imported by the package, never shipped."""
