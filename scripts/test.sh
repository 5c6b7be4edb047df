#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite: unit tests, then the
# integration and fault tests against a real Kafka broker and a real Redis that
# the tests start themselves (or REEF_BOOTSTRAP_SERVERS / REEF_REDIS_URL).
# The tests need the optional sinks' extras too (tensorboard, wandb). Also installs Debian's
# chromium where it is missing: the dashboard test renders the page
# in headless Chromium (the demo itself does not need it). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
REEF_SETUP_EXTRAS=test,tensorboard,wandb bash scripts/setup.sh
if [ ! -x /usr/bin/chromium ]; then
  printf '\033[1m==> %s\033[0m\n' "Installing Debian's chromium (headless, for the dashboard test)"
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium >/dev/null
fi
# The whole suite on two workers (pytest-xdist): tests that keep both cores busy for minutes
# (tests/conftest.py: HEAVY_FILES) run one after another on one worker, beside the other's
# lighter tests; each worker starts its own broker and Redis. With arguments (a test file, -k),
# one process, as pytest runs them.
if [ "$#" -eq 0 ]; then
  exec .venv/bin/pytest -p no:cacheprovider -ra --durations=25 -n 2 --dist loadgroup
fi
exec .venv/bin/pytest -p no:cacheprovider -ra --durations=15 "$@"
