#!/usr/bin/env bash
# The main job on the embedded default: DDTree generation side by side with AR and the DFlash chain.
# It generates code with the trained pair in checkpoints/embedded/ (a small Qwen3-architecture
# target trained on the Python standard library and its DFlash drafter), greedy, budget 64; without that
# directory it falls back to a random-weight tiny pair, whose acceptance is ~1 token per step by
# construction (the run exercises the machinery, not the speed-up).
# Extra arguments go to `ddtree-jax generate` (see `scripts/main.sh --help`).
for arg in "$@"; do
  if [ "$arg" = "-h" ] || [ "$arg" = "--help" ]; then
    cat <<'USAGE'
usage: scripts/main.sh [ddtree-jax generate options ...]

Runs `python -m ddtree_jax generate` with these options (extra arguments come after them, so they override
them; --random-tiny cannot be combined with the embedded pair's --target / --drafter: remove the checkpoints or run
`python -m ddtree_jax generate --random-tiny` directly):
  with checkpoints/embedded/{target,drafter}:
    --target checkpoints/embedded/target --drafter checkpoints/embedded/drafter
    --prompt <the start of a Python function, list_python_files(root)>
    --method all --budget 64 --max-new 128 --repeats 1
  without them (a random-weight tiny pair):
    --random-tiny --method all --budget 16 --max-new 64 --repeats 3

The options of `ddtree-jax generate`:
USAGE
    break
  fi
done
source "$(dirname "$0")/_venv.sh"
cd "$repo_root"
if [ -d checkpoints/embedded/target ] && [ -d checkpoints/embedded/drafter ]; then
  exec python -m ddtree_jax generate --target checkpoints/embedded/target --drafter checkpoints/embedded/drafter \
    --prompt $'import os\n\n\ndef list_python_files(root):\n    """Return the paths of the .py files under root."""\n' \
    --method all --budget 64 --max-new 128 --repeats 1 "$@"
fi
echo "checkpoints/embedded/ is not there yet: DDTree vs AR vs the DFlash chain on a random-weight tiny pair"
exec python -m ddtree_jax generate --random-tiny --method all --budget 16 --max-new 64 --repeats 3 "$@"
