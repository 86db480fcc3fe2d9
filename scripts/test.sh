#!/usr/bin/env bash
# Runs the whole test suite on CPU (what CI runs). Extra arguments go to pytest, e.g.
#   scripts/test.sh -m "not slow"     # the quick local loop
source "$(dirname "$0")/_venv.sh"
cd "$repo_root"
# the formatter and linter first (pyproject.toml [tool.ruff]): a style error fails fast, before the suite
ruff format --check --quiet . || { echo "error: files need 'ruff format' (run: .venv/bin/ruff format .)" >&2; exit 1; }
ruff check --quiet . || { echo "error: 'ruff check' found problems (see above)" >&2; exit 1; }
# --max-worker-restart=0: a crashed worker ends the run with an error (xdist's loadfile scheduler would
# otherwise wait forever for the crashed worker's remaining files); --durations: the 25 slowest tests close the log,
# so a CI run that nears its 30-minute budget names what to mark slow or make lighter
exec python -m pytest -n 2 --dist loadfile --max-worker-restart=0 -q --durations=25 "$@"
