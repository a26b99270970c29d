# Sourced by scripts/serve.sh and scripts/test.sh: create or reuse .venv and install the project into it.
#   SHADOWKV_TORCH_SPEC  torch requirement (default torch==2.13.0, the CPU build on this fleet's local disk;
#                        on a GPU host set e.g. "torch==2.11.0" or leave a preinstalled CUDA torch in place)
#   SHADOWKV_VENV        environment folder (default .venv in the repository)
#   SHADOWKV_EXTRAS      pip extras to install (default "test")
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${SHADOWKV_VENV:-$repo/.venv}
extras=${SHADOWKV_EXTRAS:-test}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"
# pip's own lines (Collecting, Downloading, Installing) are the install's progress: shown, not silenced
pipi() { python -m pip --disable-pip-version-check install "$@" 2>&1 | grep -v '^WARNING: Location' || true; }
# An installed torch that already satisfies the project is never replaced (it may be a CUDA build).
if ! python -c "import torch" 2>/dev/null; then
    echo "shadowkv: installing ${SHADOWKV_TORCH_SPEC:-torch==2.13.0} into $venv" >&2
    pipi "${SHADOWKV_TORCH_SPEC:-torch==2.13.0}"
fi
stamp="$venv/.shadowkv-installed-$extras"
if [ ! -f "$stamp" ] || [ "$repo/pyproject.toml" -nt "$stamp" ]; then
    echo "shadowkv: installing the project and its dependencies ($extras) into $venv" >&2
    pipi -e "$repo[$extras]"
    python -c "import shadowkv_core, kernels, serve_app"
    touch "$stamp"
fi
cd "$repo"
