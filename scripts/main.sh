#!/usr/bin/env bash
# The main job on the embedded default. Until the decode engine lands, this is the tree tool on a
# synthetic drafter distribution (L = 15, Qwen3 vocabulary, budget 64), with a plot.
# Extra arguments go to `ddtree-jax tree` (see `scripts/main.sh --help`).
source "$(dirname "$0")/_venv.sh"
cd "$repo_root"
mkdir -p outputs
exec python -m ddtree_jax tree --budget 64 --depth 15 --max-print 40 --plot outputs/tree.png "$@"
