#!/usr/bin/env bash
# The main job: replay the embedded default workload (a synthetic SWE-agent-like trace) on the
# paper's 7B hybrid profile for every policy and several cache sizes; print a table, write
# out/demo.json and out/demo.png. Extra arguments go to `python -m sglang_marconi.sim`.
source "$(dirname "$0")/venv.sh" base
exec python -m sglang_marconi.sim --model paper-7b --capacity 2GB,5GB,10GB,20GB \
  --json out/demo.json --plot out/demo.png "$@"
