#!/usr/bin/env bash
# Another commit's code beside this one, for a before / after measured in one device call (same machine, same
# warm state: the only comparison BENCHMARKS.md takes between commits run on different days is a same-call one).
#   scripts/export_commit.sh 6443aca             # -> base_6443aca/ (untracked, not ignored: the device copy has it)
#   (on the device) (cd base_6443aca && PYTHONPATH=.:kernels python -m experiments.tp_shard_step --commit 6443aca ...)
# Exports every tracked file of the commit but the archived results, the studies' results and the notebooks (the
# code, configs/, checkpoints/: what the experiments and benchmarks read). $OUT is absolute on the device, so the
# old commit's JSON lands beside the new one's: give the two runs different --tag values. Delete the folder after.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$#" -lt 1 ] || [ "$#" -gt 2 ]; then
  echo "usage: scripts/export_commit.sh COMMIT [DIR]   (DIR default: base_<COMMIT>)" >&2
  exit 2
fi
commit=$(git rev-parse --short "$1^{commit}") || { echo "error: $1 is not a commit of this repository" >&2; exit 2; }
dir=${2:-base_$1}
if [ -e "$dir" ]; then
  echo "error: $dir exists (delete it first)" >&2
  exit 2
fi
mkdir -p "$dir"
git archive "$commit" | tar -x -C "$dir" --exclude='benchmarks/results_archive' --exclude='experiments/results' \
  --exclude='notebooks'
echo "exported $commit to $dir ($(du -sh "$dir" | cut -f1)); delete it after the device call"
