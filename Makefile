# Every target sets up .venv first (scripts/setup-venv.sh; a no-op once done).
.PHONY: setup demo test lint bench

setup:
	@bash scripts/setup-venv.sh

demo: setup
	.venv/bin/dynamix demo

test: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/python -m pytest -q

lint: setup
	.venv/bin/ruff check . && .venv/bin/ruff format --check .

bench: setup
	.venv/bin/dynamix bench overhead
