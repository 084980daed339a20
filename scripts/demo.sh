#!/usr/bin/env bash
# The main job: replay the embedded default workload (a synthetic SWE-agent-like trace) on the
# paper's 7B hybrid profile for every policy and several cache sizes; print a table, write
# out/demo.json and out/demo.png. Extra arguments go to `python -m sglang_marconi.sim`.
# Progress: a bar per run on a terminal; redirected to a log (`> log.txt 2>&1`), one line per
# finished run.
source "$(dirname "$0")/venv.sh" base
exec python -m sglang_marconi.sim --model paper-7b --capacity 2GB,5GB,10GB,20GB \
  --json out/demo.json --plot out/demo.png "$@"
