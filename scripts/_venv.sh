# Sourced by scripts/main.sh and scripts/test.sh: create or reuse .venv (Python 3.12) with the
# pinned dependencies of pyproject.toml, reinstalling only when pyproject.toml changed.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${DDTREE_VENV:-$repo_root/.venv}"
stamp="$venv/.ddtree-installed"
want="$(sha256sum "$repo_root/pyproject.toml" | cut -d' ' -f1)"

find_python() {
  for candidate in python3.12 "$(command -v pyenv >/dev/null 2>&1 && pyenv root)/versions/3.12.1/bin/python3"; do
    if [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 \
        && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  if PYENV_VERSION=3.12.1 python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
    echo "env PYENV_VERSION=3.12.1 python3"; return 0
  fi
  echo "error: Python 3.12 not found (install it, e.g. 'pyenv install 3.12.1')" >&2
  return 1
}

if [ ! -x "$venv/bin/python" ]; then
  py="$(find_python)"
  echo "[setup] creating $venv with $($py --version)" >&2
  $py -m venv "$venv"
fi
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[setup] installing ddtree-jax and its pinned dependencies into $venv" >&2
  log="$venv/pip-install.log"
  { "$venv/bin/python" -m pip install -q --upgrade pip \
      && "$venv/bin/python" -m pip install -q -e "$repo_root[dev]"; } >"$log" 2>&1 \
    || { cat "$log" >&2; echo "error: installing the environment failed (log: $log)" >&2; exit 1; }
  echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
export PYTHONPATH="$repo_root:$repo_root/kernels${PYTHONPATH:+:$PYTHONPATH}"
