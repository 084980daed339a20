# Sourced by the scripts below: create or update the project's virtualenv in .venv and activate it.
# Needs only python3 (>= 3.11) and access to the package registry.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
# Re-install only when pyproject.toml changed since the last install.
stamp="$venv/.installed-$(sha1sum "$root/pyproject.toml" | cut -c1-12)-${1:-base}"
if [ ! -f "$stamp" ]; then
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -e "$root${2:-}"
  rm -f "$venv"/.installed-*-"${1:-base}"
  touch "$stamp"
fi
# shellcheck disable=SC1091
source "$venv/bin/activate"
cd "$root"
