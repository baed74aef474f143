# The two commands of the README. Each does all set-up itself (scripts/setup.sh is idempotent).
.PHONY: setup run test

setup:
	bash scripts/setup.sh

run: setup
	.venv/bin/python -m jaxinfer.entrypoints.cli generate --no-warmup

test: setup
	.venv/bin/python -m pytest -q --durations=15 tests
