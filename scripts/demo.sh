#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: `reef demo`, the whole loop on the local
# Kafka broker and Redis (started here when they are not running), until the policy learns
# the toy task from reward alone. Arguments go to `reef demo` (see `reef demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/reef demo "$@"
