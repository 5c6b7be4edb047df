#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite: unit tests, then the
# integration and fault tests against a real Kafka broker and a real Redis that
# the tests start themselves (or REEF_BOOTSTRAP_SERVERS / REEF_REDIS_URL).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/pytest -p no:cacheprovider -ra --durations=15 "$@"
