#!/usr/bin/env bash
# The whole test suite, from nothing: builds .venv with the test extras and the pinned SGLang
# (CPU), then runs pytest (given no arguments: the whole suite, on two workers).
# SGLANG_MARCONI_SKIP_SGLANG=1 skips the SGLang install (and its tests).
source "$(dirname "$0")/venv.sh" test "[test]"
if [ -z "${SGLANG_MARCONI_SKIP_SGLANG:-}" ]; then
  source "$root/scripts/install_sglang_cpu.sh"
fi
if [ "$#" -eq 0 ]; then
  # The whole suite on two workers: the live-server tests stay together on one of them
  # (tests/conftest.py groups them), the other runs the in-process tests beside them.
  set -- -n 2 --dist loadgroup --durations=30
fi
exec python -m pytest "$@"
