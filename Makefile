# Every target sets up .venv itself (scripts/setup-env) on first use.
PY := .venv/bin/python
# pytest-xdist workers for the suite: a process world mostly waits (timeouts, rendezvous, a killed
# rank's peers), so three workers keep two cores busy; files stay whole on one worker (their shared
# worlds start once). WORKERS=0 runs in this process.
WORKERS ?= 3
XDIST := $(if $(filter 0,$(WORKERS)),-p no:xdist,-n $(WORKERS) --dist loadfile)
# RES_OPTIONS: torch looks up the name of every TCP peer it connects or accepts (store clients,
# gloo pairs); where no DNS server answers (a sandbox, CI) one lookup in about 25 made at once
# stalls 5 s (docs/guide.md, "The control plane at scale"), longer than some tests' deadlines.
# Every address here is 127.0.0.1 or localhost (/etc/hosts), so a DNS lookup that fails at once
# loses nothing; set RES_OPTIONS yourself to run with the resolver as it is. Not for set-up: pip
# needs DNS.
RUN = RES_OPTIONS=$${RES_OPTIONS:-attempts:0} $(PY)

.PHONY: setup demo test test-fast test-torch-dependent test-titan test-titan-ci lint bench wheel-check ci
setup:
	@scripts/setup-env

demo: setup
	$(RUN) -m commgroups demo

# Then, alone, the tests that load every core on purpose (they would starve the tests beside them).
test: setup
	$(RUN) -m pytest -q $(XDIST)
	$(RUN) -m pytest -q -p no:xdist -m loads_cores

# The fast loop (under a minute): pure logic only, no process worlds (a file that starts them says
# `pytestmark = pytest.mark.world`, tests/README.md) and none of the heavy pure tests (fake worlds of
# thousands of ranks, fuzzing: `pytest.mark.heavy`); `make test` runs both.
test-fast: setup
	$(RUN) -m pytest -q -n 2 -m "not world and not heavy"

# The tests CI's extra torch legs run (tests/README.md, "Which tests run on every torch"):
# make test-torch-dependent PY=.venv-torch2.15/bin/python
test-torch-dependent: setup
	$(RUN) -m pytest -q $(XDIST) -m "torch_dependent and not titan_matrix and not loads_cores"
	$(RUN) -m pytest -q -p no:xdist -m "torch_dependent and loads_cores"

# torchtitan (excluded from `make test`): against stock, the isolation matrix and the train/resume/MoE
# scenarios; with_registry under torchrun elastic losing a node (tests/test_restart.py, its
# titan_matrix test); -rP prints every loss and grad norm.
TITAN_TESTS := tests/test_torchtitan_matrix.py tests/test_torchtitan_train.py tests/test_restart.py
test-titan: setup
	$(RUN) -m pytest -q -rP -p no:xdist -m titan_matrix $(TITAN_TESTS)

# CI's torchtitan subset (tests/titan/matrix.py CI_JOBS: each spmd backend once, each isolation
# hazard once, one resume, one restart), trained in one 4-rank world plus the restart.
test-titan-ci: setup
	$(RUN) -m pytest -q -rP -p no:xdist -m "titan_matrix and titan_ci" $(TITAN_TESTS)

lint: setup
	.venv/bin/ruff check commgroups backends tests benchmarks tools
	.venv/bin/mypy

bench: setup
	$(RUN) -m commgroups bench --quick --json out/bench.json --plot out

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
