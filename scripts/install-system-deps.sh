#!/usr/bin/env bash
# Install the Debian tools the tests and benchmarks use, if missing: wrk and h2load (load), prometheus and
# promtool (rules and scraping tests), redis-server (the shared store), docker-compose (compose validation).
set -euo pipefail
need=()
command -v wrk >/dev/null || need+=(wrk)
command -v h2load >/dev/null || need+=(nghttp2-client)
[ ${#need[@]} -eq 0 ] && exit 0
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
echo "installing Debian packages: ${need[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
