#!/usr/bin/env bash
# The main job on the embedded default: DDTree generation side by side with AR and the DFlash chain.
# It generates code with the trained pair in checkpoints/embedded/ (a small Qwen3-architecture
# target trained on the Python standard library and its DFlash drafter), greedy, budget 64; without that
# directory it falls back to a random-weight tiny pair, whose acceptance is ~1 token per step by
# construction (the run exercises the machinery, not the speed-up).
# Extra arguments go to `ddtree-jax generate` (see `scripts/main.sh --help`).
source "$(dirname "$0")/_venv.sh"
cd "$repo_root"
if [ -d checkpoints/embedded/target ] && [ -d checkpoints/embedded/drafter ]; then
  exec python -m ddtree_jax generate --target checkpoints/embedded/target --drafter checkpoints/embedded/drafter \
    --prompt $'import os\n\n\ndef list_python_files(root):\n    """Return the paths of the .py files under root."""\n' \
    --method all --budget 64 --max-new 128 --repeats 1 "$@"
fi
echo "checkpoints/embedded/ is not there yet: DDTree vs AR vs the DFlash chain on a random-weight tiny pair"
exec python -m ddtree_jax generate --random-tiny --method all --budget 16 --max-new 64 --repeats 3 "$@"
