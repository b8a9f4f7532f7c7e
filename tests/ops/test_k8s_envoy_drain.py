"""Envoy's Kubernetes additions, run for real: the health port (/ready, /stats/prometheus) and the preStop drain.

Envoy runs with envoy.yaml (rendered for loopback, without the ext_proc: what is tested is Envoy's own drain) plus
the `--config-yaml` of deploy/k8s's Envoy Deployment, and the preStop script is run as the kubelet would.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import yaml

from extproc.tools import envoyconf
from extproc.tools.stack import free_port, wait_http
from tests.conftest import stop_process

from .conftest import ROOT

COMPONENT = ROOT / "deploy" / "k8s" / "components" / "envoy"
HEALTH_PORT, ADMIN_PORT = 9902, 9901   # what the Deployment uses; replaced by free ports here


def deployment_args() -> list[str]:
    (deployment,) = [d for d in yaml.safe_load_all((COMPONENT / "envoy.yaml").read_text()) if d["kind"] == "Deployment"]
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def kubernetes_additions(health_port: int, admin_port: int) -> str:
    args = deployment_args()
    extra = yaml.safe_load(args[args.index("--config-yaml") + 1])
    (listener,) = extra["static_resources"]["listeners"]
    assert listener["address"]["socket_address"]["port_value"] == HEALTH_PORT
    listener["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": health_port}
    (admin,) = extra["static_resources"]["clusters"]
    address = admin["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert address["port_value"] == ADMIN_PORT
    address["port_value"] = admin_port
    return yaml.safe_dump(extra)


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.fixture
def envoy(tmp_path):
    """(listen URL, health URL, admin port) of an Envoy started as the Deployment starts it, fronting the test
    upstream."""
    args = deployment_args()
    with started_envoy(tmp_path, args[args.index("--drain-time-s") + 1]) as urls:
        yield urls


@contextlib.contextmanager
def started_envoy(tmp_path, drain_time_s: str):
    with contextlib.ExitStack() as stops:  # every process started is stopped, even where an earlier stop raised
        upstream_port = free_port()
        upstream = subprocess.Popen([sys.executable, str(ROOT / "tests" / "upstream.py"), str(upstream_port)],
                                    start_new_session=True)
        stops.callback(stop_process, upstream, 10.0)
        listen, health, admin = free_port(), free_port(), free_port()
        cfg = envoyconf.render(envoyconf.load_source(), listen_port=listen, admin_port=admin, extproc=None,
                               mode="plain", pools={"vllm_llama70b": [("127.0.0.1", upstream_port)]})
        path = tmp_path / "envoy.yaml"
        path.write_text(yaml.safe_dump(cfg))
        args = deployment_args()
        proc = subprocess.Popen([envoyconf.envoy_binary(), "-c", str(path), "--config-yaml",
                                 kubernetes_additions(health, admin), "--disable-hot-restart",
                                 "--drain-strategy", args[args.index("--drain-strategy") + 1],
                                 "--drain-time-s", drain_time_s, "--log-level", "error"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        stops.callback(stop_process, proc, 10.0)
        wait_http(f"http://127.0.0.1:{upstream_port}/health", timeout=20, proc=upstream)
        wait_http(f"http://127.0.0.1:{health}/ready", timeout=20, proc=proc)
        yield f"http://127.0.0.1:{listen}", f"http://127.0.0.1:{health}", admin


def prestop(admin_port: int, stream_drain_s: float) -> tuple[subprocess.CompletedProcess, float]:
    env = {"PATH": "/usr/bin:/bin", "ENVOY_ADMIN_PORT": str(admin_port), "LB_DEREGISTER_S": "0.2",
           "STREAM_DRAIN_S": str(stream_drain_s)}
    start = time.monotonic()
    done = subprocess.run(["bash", str(COMPONENT / "prestop.sh")], env=env, capture_output=True, text=True,
                          timeout=stream_drain_s + 10)
    return done, time.monotonic() - start


def test_health_port_serves_ready_and_envoy_stats_but_not_the_admin(envoy):
    _, health, _ = envoy
    assert status(f"{health}/ready") == 200
    with urllib.request.urlopen(f"{health}/stats/prometheus", timeout=5) as r:
        assert b"envoy_server_live" in r.read()
    assert status(f"{health}/quitquitquit") == 404   # only /ready and the stats are reachable from the pod IP


def test_prestop_turns_ready_off_and_waits_for_a_stream_in_flight(envoy):
    url, health, admin = envoy
    result = {}

    def slow_request():
        req = urllib.request.Request(f"{url}/v1/chat/completions", method="POST",
                                     data=b'{"model":"llama-70b","messages":[{"role":"user"}],"max_tokens":4}',
                                     headers={"content-type": "application/json", "x-test-delay-ms": "1500"})
        with urllib.request.urlopen(req, timeout=10) as r:
            result["status"] = r.status

    client = threading.Thread(target=slow_request)
    client.start()
    time.sleep(0.3)
    done, elapsed = prestop(admin, stream_drain_s=10)
    client.join()
    assert done.returncode == 0, done.stderr
    assert result["status"] == 200            # the request in flight finished, not cut
    assert 1.0 <= elapsed < 5                 # the hook waited for it, and no longer
    assert status(f"{health}/ready") == 503   # out of the Service and the load balancers


def test_prestop_gives_up_after_stream_drain_s(envoy):
    url, _, admin = envoy

    def stuck_request():
        req = urllib.request.Request(f"{url}/v1/chat/completions", method="POST", data=b"{}",
                                     headers={"content-type": "application/json", "x-test-delay-ms": "6000"})
        try:
            urllib.request.urlopen(req, timeout=10).read()
        except OSError:
            pass

    threading.Thread(target=stuck_request, daemon=True).start()
    time.sleep(0.3)
    done, elapsed = prestop(admin, stream_drain_s=1)
    assert done.returncode == 0 and elapsed < 3.5


def test_prestop_closes_the_openai_listener_after_the_drain_time_and_keeps_the_health_port(tmp_path):
    # prestop.sh drains with `inboundonly`, which stops only listeners marked INBOUND: envoy.yaml's `openai` was not,
    # so it kept accepting connections through the whole wait (docs/kubernetes.md: "the listener closes after
    # --drain-time-s"). The health listener stays, so /ready keeps saying 503 and Prometheus keeps its stats.
    with started_envoy(tmp_path, "1") as (url, health, admin):
        done, _ = prestop(admin, stream_drain_s=1)
        assert done.returncode == 0, done.stderr
        time.sleep(2.0)   # past the 1 s drain time
        port = int(url.rsplit(":", 1)[1])
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        assert status(f"{health}/ready") == 503
        with urllib.request.urlopen(f"{health}/stats/prometheus", timeout=5) as r:
            assert b"envoy_server_live" in r.read()
