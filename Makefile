# Every target sets up .venv itself (scripts/setup-env) on first use.
PY := .venv/bin/python

.PHONY: setup demo test test-titan lint bench ci
setup:
	@scripts/setup-env

demo: setup
	$(PY) -m commgroups demo

test: setup
	$(PY) -m pytest -q

# The torchtitan isolation matrix (excluded from `make test`); -rP prints every loss and grad norm.
test-titan: setup
	$(PY) -m pytest -q -rP -m titan_matrix tests/test_torchtitan_matrix.py

lint: setup
	.venv/bin/ruff check commgroups backends tests benchmarks
	.venv/bin/mypy

bench: setup
	$(PY) -m commgroups bench --quick --json out/bench.json --plot out

ci:
	.ci/run

# GPU check (benchmarks/README.md, "GPU check"). gpu-wheels needs the package index; gpu-check needs
# no .venv (the GPU machine has none): without a CUDA device it says so and exits 0.
.PHONY: gpu-wheels gpu-check gpu-smoke
gpu-wheels: setup
	@scripts/gpu-wheels

gpu-check:
	@scripts/gpu-check

gpu-smoke: setup
	@scripts/gpu-check --cpu-smoke
