#!/usr/bin/env bash
# Runs the whole test suite on CPU (what CI runs). Extra arguments go to pytest, e.g.
#   scripts/test.sh -m "not slow"     # the quick local loop
source "$(dirname "$0")/_venv.sh"
cd "$repo_root"
exec python -m pytest -n 2 --dist loadfile -q "$@"
