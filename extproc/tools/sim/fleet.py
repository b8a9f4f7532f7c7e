"""Several simulated replicas in one process, each on its own port: `async with SimFleet(...) as fleet`."""

from __future__ import annotations

import asyncio

from extproc.tools.sim.http11 import HttpServerProtocol
from extproc.tools.sim.lora import parse_module, runtime_updating_from_env
from extproc.tools.sim.profile import Profile, load_profile
from extproc.tools.sim.replica import Replica


class SimFleet:
    """N independent replicas on ports port..port+N-1 (port 0: ephemeral ports, see `.ports`/`.urls`)."""

    def __init__(self, profile: Profile | str, replicas: int = 1, host: str = "127.0.0.1", port: int = 0,
                 speed: float = 1.0, model_names: list[str] | None = None, seed: int = 0,
                 scheduling_policy: str | None = None, lora_modules: list[str] = (),
                 runtime_lora: bool | None = None, max_loras: int = 1):
        """`lora_modules`: vLLM's `--lora-modules` values (`name=path` or JSON); `runtime_lora`: serve the
        load/unload endpoints (default: as VLLM_ALLOW_RUNTIME_LORA_UPDATING says, as vLLM does); `max_loras`:
        vLLM's --max-loras (default 1, as vLLM's): adapters in one batch at most."""
        profile = load_profile(profile) if isinstance(profile, str) else profile
        if model_names:
            profile = profile.with_model_names(model_names)
        if scheduling_policy:
            profile = profile.with_scheduling_policy(scheduling_policy)
        if speed <= 0:
            raise ValueError("speed must be positive")
        self.profile = profile
        self.host = host
        self.base_port = port
        adapters = [parse_module(m) for m in lora_modules]
        runtime = runtime_updating_from_env() if runtime_lora is None else runtime_lora
        self.replicas = [Replica(profile, speed=speed, seed=seed + i, lora_modules=adapters, runtime_lora=runtime,
                                 max_loras=max_loras) for i in range(replicas)]
        self.servers: list[asyncio.AbstractServer] = []
        self.ports: list[int] = []

    @property
    def urls(self) -> list[str]:
        return [f"http://{self.host}:{p}" for p in self.ports]

    async def start(self) -> SimFleet:
        loop = asyncio.get_running_loop()
        try:
            for i, replica in enumerate(self.replicas):
                port = self.base_port + i if self.base_port else 0
                server = await loop.create_server(lambda r=replica: HttpServerProtocol(r.handle), self.host, port,
                                                  reuse_address=True, backlog=1024)
                self.servers.append(server)
                self.ports.append(server.sockets[0].getsockname()[1])
                replica.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def stop(self) -> None:
        for server in self.servers:
            server.close()
        for replica in self.replicas:
            await replica.stop()
        for server in self.servers:
            try:
                await asyncio.wait_for(server.wait_closed(), 1.0)
            except TimeoutError:
                pass  # open keep-alive connections; closing the listener is enough
        self.servers.clear()

    async def __aenter__(self) -> SimFleet:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()
