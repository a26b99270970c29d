#!/usr/bin/env bash
# README's main command: set up (or reuse) .venv, then serve the embedded default (CPU, the shipped small model)
# on 127.0.0.1:8000, or the Serve config SHADOWKV_CONFIG names. Extra arguments go to `serve run`.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/env.sh"
# the HTTP proxy sheds completion requests beyond the service's capacity before forwarding them (serve_app/edge.py)
export RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=${RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH:-serve_app.edge:proxy_middlewares}
# SIGTERM (docker stop, systemd, kill) then stops Ray quietly, without Ray's crash-style stack dump of the driver
export RAY_DISABLE_FAILURE_SIGNAL_HANDLER=${RAY_DISABLE_FAILURE_SIGNAL_HANDLER:-1}
exec serve run "${SHADOWKV_CONFIG:-configs/local.yaml}" "$@"
