#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: bring up the local Kafka
# broker and Redis, create the topics, print the cluster's status.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/reef up "$@"
