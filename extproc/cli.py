"""`extproc` command line: serve | check | sim | stack | demo | ... (each subcommand lives in its own module)."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

# name -> (module, help). Each module defines add_arguments(parser) and run(args) -> int.
# Modules are imported lazily so `extproc check` does not pay for gRPC or aiohttp.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("extproc.server.main", "run the ext_proc gRPC server and its metrics/health HTTP endpoint"),
    "check": ("extproc.tools.check", "validate a policy YAML file without starting anything"),
    "sim": ("extproc.tools.sim.cli", "run simulated vLLM replicas (OpenAI API, SSE, vLLM /metrics)"),
    "loadgen": ("extproc.tools.loadgen", "send OpenAI traffic (closed or open loop) and report latency"),
    "stack": ("extproc.tools.stack", "start a local stack: Envoy + ext_proc in front of the given pools"),
    "envoy-config": ("extproc.tools.envoyconf", "render envoy/envoy.yaml for a local stack (ports, addresses)"),
    "calibrate": ("extproc.tools.calibrate.cli",
                  "find a class's concurrency cap by a load sweep of the target (p95 vs SLO)"),
    "demo": ("extproc.tools.demo", "the traffic-spike demo: five ways to serve the same spike, side by side"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="extproc", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        # Argument definitions are imported only for the chosen command (see main).
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0] in SUBCOMMANDS:
        if argv[0] == "serve":
            # SIGHUP asks the server to reload, but its default action ends the process: one sent while it
            # starts (a reload script racing a restart) killed it without a word. Ignored until the server's
            # event loop takes it over; a file changed meanwhile is reloaded then (Server.run).
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
        module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
        p = argparse.ArgumentParser(prog=f"extproc {argv[0]}", description=SUBCOMMANDS[argv[0]][1])
        module.add_arguments(p)
        args = p.parse_args(argv[1:])
        return int(module.run(args) or 0)
    parser.parse_args(argv)  # prints usage / error for unknown commands
    return 2


if __name__ == "__main__":
    sys.exit(main())
