#!/bin/bash
# Envoy's preStop hook: leave the load balancers, then let streams in flight finish, then let SIGTERM stop Envoy.
#
#   1. POST /healthcheck/fail: the health port's /ready turns 503, so the readiness probe takes the pod out of the
#      Service and any load balancer health-checking it stops sending; wait LB_DEREGISTER_S for that to happen.
#   2. POST /drain_listeners?graceful: clients are told to close their connections and the listener closes
#      after --drain-time-s; requests already running continue.
#   3. Wait until no downstream request is active on the `openai` listener, at most STREAM_DRAIN_S seconds.
#
# Talks to the admin on loopback with bash's /dev/tcp, in HTTP/1.1 (the admin refuses 1.0): the Envoy image has
# no curl. Keep LB_DEREGISTER_S + STREAM_DRAIN_S below the pod's terminationGracePeriodSeconds.
# tests/ops/test_k8s_envoy_drain.py runs this script against a real Envoy.
set -u
admin_port=${ENVOY_ADMIN_PORT:-9901}

admin() {  # METHOD PATH: print the response body
  exec 3<>"/dev/tcp/127.0.0.1/${admin_port}" || return 1
  printf '%s %s HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n' "$1" "$2" >&3
  sed '1,/^\r$/d' <&3
  exec 3<&-
}

active_requests() {
  admin GET '/stats?filter=^http\.openai\.downstream_rq_active$' | sed -n 's/^http\.openai\.downstream_rq_active: //p'
}

admin POST /healthcheck/fail >/dev/null
sleep "${LB_DEREGISTER_S:-15}"
admin POST '/drain_listeners?graceful&inboundonly' >/dev/null
deadline=$((SECONDS + ${STREAM_DRAIN_S:-120}))
while [ "$SECONDS" -lt "$deadline" ]; do
  active=$(active_requests)
  [ "${active:-0}" -eq 0 ] && exit 0
  sleep 1
done
