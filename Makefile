# Every target sets up .venv first (scripts/setup-venv.sh; a no-op once done).
.PHONY: setup demo test test-fast lint bench

setup:
	@bash scripts/setup-venv.sh

demo: setup
	.venv/bin/dynamix demo

# two pytest-xdist workers, a test file to one worker (so a module's fixtures, a job's run, run once)
test: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/python -m pytest -q -n 2 --dist loadfile

# the inner loop: every module's unit tests, without those that start other Pythons or run end to end (make test runs all),
# on two pytest-xdist workers
test-fast: setup
	.venv/bin/ruff check .
	.venv/bin/python -m pytest -q -n 2 -m "not distributed and not e2e"

lint: setup
	.venv/bin/ruff check . && .venv/bin/ruff format --check .

bench: setup
	.venv/bin/dynamix bench overhead
