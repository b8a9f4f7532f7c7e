"""`extproc sim`: run N simulated vLLM replicas on consecutive ports until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import errno
import signal
import sys

from extproc.tools.sim.fleet import SimFleet
from extproc.tools.sim.profile import shipped_profile_names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default="h100-llama70b-awq",
                        help=f"shipped profile ({', '.join(shipped_profile_names())}) or a YAML file path")
    parser.add_argument("--replicas", type=int, default=1, help="number of replicas (ports P..P+N-1)")
    parser.add_argument("--port", type=int, default=8100, help="first port; 0 picks free ports")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--speed", type=float, default=1.0, help="simulated seconds per real second")
    parser.add_argument("--model-name", action="append", dest="model_names", metavar="NAME",
                        help="served model name (repeatable); default: the profile's")
    parser.add_argument("--lora-modules", nargs="+", action="extend", default=[], metavar="NAME=PATH",
                        help="LoRA adapters served on top of the model, as vLLM's flag: name=path or JSON "
                             "{\"name\", \"path\", \"base_model_name\"}; with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true "
                             "in the environment POST /v1/load_lora_adapter and /v1/unload_lora_adapter add more")
    parser.add_argument("--max-loras", type=int, default=1,
                        help="vLLM's --max-loras: LoRA adapters in one batch at most (vLLM's default 1); a request "
                             "for another adapter waits until one's requests end")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default=None,
                        help="vLLM's --scheduling-policy: priority orders by the request's `priority` (lower first) "
                             "and preempts the worst running one; default: the profile's (fcfs unless it says)")
    parser.add_argument("--no-uvloop", action="store_true", help="use the standard asyncio event loop")


async def _serve(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with SimFleet(args.profile, replicas=args.replicas, host=args.host, port=args.port, speed=args.speed,
                        model_names=args.model_names, seed=args.seed,
                        scheduling_policy=args.scheduling_policy, lora_modules=args.lora_modules,
                        max_loras=args.max_loras) as fleet:
        print(f"sim ready: {' '.join(fleet.urls)} profile={fleet.profile.name} "
              f"models={','.join(fleet.profile.model_names)} "
              f"lora={','.join(fleet.replicas[0].loras.adapters) or '-'} speed={args.speed:g} "
              f"scheduling={fleet.profile.scheduling_policy}", flush=True)
        await stop.wait()


def run(args: argparse.Namespace) -> int:
    try:
        if args.no_uvloop:
            asyncio.run(_serve(args))
        else:
            import uvloop
            uvloop.run(_serve(args))
    except OSError as e:
        if e.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
            raise
        last = args.port + args.replicas - 1
        ports = f"{args.port}-{last}" if args.port and last > args.port else str(args.port)
        print(f"extproc sim: cannot listen on {args.host} port {ports} ({e.strerror or e})", file=sys.stderr)
        return 1
    return 0
