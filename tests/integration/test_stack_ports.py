"""The local stack's ports: picked where outgoing connections do not get theirs, and a port taken between the
pick and the bind makes the stack start again on new ones instead of failing (a CI run failed on that)."""

from __future__ import annotations

import socket
import urllib.request

from extproc.tools.stack import Stack, _ephemeral_low, free_port
from tests.conftest import policy_file


def test_free_ports_are_below_the_ephemeral_range_and_not_repeated():
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(p < _ephemeral_low() for p in ports)


def test_a_taken_port_makes_the_stack_start_on_new_ones(tmp_path, upstream):
    s = Stack(tmp_path / "stack", {"vllm_llama70b": [upstream], "vllm_llama8b": [upstream]},
              policy_path=policy_file(tmp_path))
    taken = s.listen_port
    with socket.socket() as squatter:  # another process got Envoy's listener port first
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        try:
            s.start()
            assert s.listen_port != taken
            with urllib.request.urlopen(f"{s.admin_url}/ready", timeout=5) as r:
                assert r.status == 200
            assert "already in use" in (s.workdir / "envoy.log").read_text()  # the first try did fail on it
        finally:
            s.stop()
