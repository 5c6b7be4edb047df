#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite: unit tests, then the
# integration and fault tests against a real Kafka broker and a real Redis that
# the tests start themselves (or REEF_BOOTSTRAP_SERVERS / REEF_REDIS_URL).
# The tests need the optional extras too (tensorboard, wandb, s3). Also installs Debian's
# chromium where it is missing: the dashboard test renders the page
# in headless Chromium (the demo itself does not need it). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# The vLLM engine's environment too: the engine tests and `reef demo --engine vllm`'s test use it.
REEF_SETUP_EXTRAS=test,tensorboard,wandb,s3 REEF_SETUP_ENGINES=vllm bash scripts/setup.sh
if [ ! -x /usr/bin/chromium ]; then
  printf '\033[1m==> %s\033[0m\n' "Installing Debian's chromium (headless, for the dashboard test)"
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium >/dev/null
fi
# The whole suite: first every test but the heavy ones on two pytest-xdist workers (each starts
# its own broker and Redis), then the heavy ones (tests/conftest.py: HEAVY_FILES; whole demo
# loops, vLLM, long fault runs) alone, one after another. With arguments (a test file, -k):
# one process, as pytest runs them.
if [ "$#" -eq 0 ]; then
  status=0
  .venv/bin/pytest -p no:cacheprovider -ra --durations=20 -n 2 -m "not heavy" || status=$?
  .venv/bin/pytest -p no:cacheprovider -ra --durations=15 -m heavy || status=$?
  exit "$status"
fi
exec .venv/bin/pytest -p no:cacheprovider -ra --durations=15 "$@"
