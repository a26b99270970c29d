#!/usr/bin/env bash
# README's test command: set up (or reuse) .venv, then run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec python -m pytest "$@"
