#!/usr/bin/env bash
# A cluster on a laptop: N tiny CPU servers (the `marconi` backend, as scripts/serve_tiny.sh serves
# them) behind SGLang's gateway `smg` (`--policy cache_aware`), all on 127.0.0.1:
#   bash scripts/serve_cluster.sh --workers 2 --port 30100 [smg flags...] [-- worker flags...]
# The gateway listens on --port, the workers on the ports after it (--worker-base-port Q: from Q).
# Other options: --policy P, --kind mamba2, --launcher sglang (upstream's cache). SIGTERM or Ctrl-C
# stops every process it started (SIGTERM, a short grace, then SIGKILL, by process group).
# Builds .venv with the pinned SGLang and smg on first use.
source "$(dirname "$0")/venv.sh" test "[test]"
source "$root/scripts/install_sglang_cpu.sh"
exec python tests/server/cluster_server.py "$@"
