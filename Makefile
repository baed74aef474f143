# The two commands of the README. Each does all set-up itself (scripts/setup.sh is idempotent).
.PHONY: setup run test

setup:
	bash scripts/setup.sh

run: setup
	.venv/bin/python -m jaxinfer.entrypoints.cli generate --no-warmup

test: setup
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir .cache/site
	.venv/bin/python -m pytest -q --durations=15 tests
