# Every target sets up .venv itself (scripts/setup-env) on first use.
PY := .venv/bin/python

.PHONY: setup demo test lint bench ci
setup:
	@scripts/setup-env

demo: setup
	$(PY) -m commgroups demo

test: setup
	$(PY) -m pytest -q

lint: setup
	.venv/bin/ruff check commgroups backends tests benchmarks
	.venv/bin/mypy

bench: setup
	$(PY) -m commgroups bench --quick --json out/bench.json --plot out

ci:
	.ci/run
