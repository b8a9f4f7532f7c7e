#!/usr/bin/env bash
# Install the Debian tools the tests and benchmarks use, if missing: wrk and h2load (load), prometheus and
# promtool (rules and scraping tests), docker-compose (compose file validation, no engine needed), jq,
# redis-server (the shared store's tests start their own on a free loopback port).
set -euo pipefail
need=()
command -v wrk >/dev/null || need+=(wrk)
command -v h2load >/dev/null || need+=(nghttp2-client)
{ command -v prometheus >/dev/null && command -v promtool >/dev/null; } || need+=(prometheus)
command -v docker-compose >/dev/null || need+=(docker-compose)
command -v jq >/dev/null || need+=(jq)
command -v redis-server >/dev/null || need+=(redis-server)
[ ${#need[@]} -eq 0 ] && exit 0
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
echo "installing Debian packages: ${need[*]}"
$SUDO apt-get update -qq
# --no-install-recommends keeps prometheus from pulling in node-exporter. The tests start their own prometheus on a
# free loopback port, so a packaged service (if the host starts one) does not get in their way (redis-server too).
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
