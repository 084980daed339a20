#!/usr/bin/env bash
# The whole test suite, from nothing: builds .venv with the test extras, then runs pytest.
source "$(dirname "$0")/venv.sh" test "[test]"
exec python -m pytest "$@"
