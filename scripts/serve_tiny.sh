#!/usr/bin/env bash
# Try the server on a laptop: a tiny random hybrid model (gated delta net + attention) served by
# SGLang's CPU engine through `python -m sglang_marconi.launch_server` on http://127.0.0.1:30000.
# Builds .venv with the pinned SGLang on first use. Extra arguments go to tests/server/live_server.py
# (--kind mamba2, --port N, --launcher sglang) and then to SGLang.
source "$(dirname "$0")/venv.sh" test "[test]"
source "$root/scripts/install_sglang_cpu.sh"
exec python tests/server/live_server.py "$@"
