#!/usr/bin/env bash
# The whole test suite, from nothing: builds .venv with the test extras and the pinned SGLang
# (CPU), then runs pytest. SGLANG_MARCONI_SKIP_SGLANG=1 skips the SGLang install (and its tests).
source "$(dirname "$0")/venv.sh" test "[test]"
if [ -z "${SGLANG_MARCONI_SKIP_SGLANG:-}" ]; then
  source "$root/scripts/install_sglang_cpu.sh"
fi
exec python -m pytest "$@"
