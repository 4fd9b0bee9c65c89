# Every target sets up .venv itself (scripts/setup-env) on first use.
PY := .venv/bin/python

.PHONY: setup demo test test-fast test-titan lint bench wheel-check ci
setup:
	@scripts/setup-env

demo: setup
	$(PY) -m commgroups demo

test: setup
	$(PY) -m pytest -q

# The fast loop (under a minute): pure logic only, no process worlds (a file that starts them says
# `pytestmark = pytest.mark.world`, tests/README.md) and none of the heavy pure tests (fake worlds of
# thousands of ranks, fuzzing: `pytest.mark.heavy`); `make test` runs both.
test-fast: setup
	$(PY) -m pytest -q -m "not world and not heavy"

# torchtitan (excluded from `make test`): against stock, the isolation matrix and the train/resume/MoE
# scenarios; with_registry under torchrun elastic losing a node (tests/test_restart.py, its
# titan_matrix test); -rP prints every loss and grad norm.
test-titan: setup
	$(PY) -m pytest -q -rP -m titan_matrix tests/test_torchtitan_matrix.py tests/test_torchtitan_train.py \
	  tests/test_restart.py

lint: setup
	.venv/bin/ruff check commgroups backends tests benchmarks tools
	.venv/bin/mypy

bench: setup
	$(PY) -m commgroups bench --quick --json out/bench.json --plot out

# The wheel in a clean venv: commgroups plan, demo and bench --smoke from outside the tree.
wheel-check: setup
	@scripts/wheel-check

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
