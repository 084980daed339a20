#!/usr/bin/env bash
# A cluster on a laptop: N tiny CPU servers (the `marconi` backend, as scripts/serve_tiny.sh serves
# them) behind SGLang's gateway `smg` (`--policy cache_aware`), all on 127.0.0.1:
#   bash scripts/serve_cluster.sh --workers 2 --port 30100 [smg flags...] [-- worker flags...]
# The gateway answers on --port, the workers on the ports after it (--worker-base-port Q: from Q).
# --port is bound only once smg counts every worker healthy and routes a generation (smg itself
# listens on a free port, relayed from --port): a client that can connect is served, so wait for
# the cluster by connecting, e.g. `until (: </dev/tcp/127.0.0.1/30100) 2>/dev/null; do sleep 1; done`.
# Other options: --policy P, --kind mamba2, --launcher sglang (upstream's cache). SIGTERM or Ctrl-C
# stops every process it started (SIGTERM, a short grace, then SIGKILL, by process group).
# Builds .venv with the pinned SGLang and smg on first use.
source "$(dirname "$0")/venv.sh" test "[test]"
source "$root/scripts/install_sglang_cpu.sh"
exec python tests/server/cluster_server.py "$@"
