"""A model of how the ext_proc reads each replica and steers requests around the bad ones, driven by random
sequences on a virtual clock: the real PoolScraper rounds (against simulated vLLM replicas behind a fake HTTP
session, Envoy's admin host list included), the real core's steering (AdmissionController.replicas_for,
replica_answered) and a PoolGate's stall accounting, with Envoy's override_host picking as docs/envoy-integration.md
says. After every step it checks what docs/reliability.md, policy.steering and server.saturation promise:

- with nothing known wrong in a pool its requests name no replica (Envoy picks);
- while a replica is stalled, a request names replicas, none of them known stalled, dead, unhealthy or gone,
  each once, as Envoy lists its hosts (IP:PORT, IPv6 in brackets);
- a class with an SLO names the slow replicas last, the others are not steered for a slow replica alone;
- a replica holding requests with its counters still is seen stalled within stall_ms (and a scrape or two), and
  taken back at the first scrape that sees them move (or that sees it restarted);
- readings of removed replicas are forgotten, answers of replicas no longer counted are not kept past Envoy's
  ejection time;
- a pool's stalled share (PoolGate.stuck) is never negative nor over what it holds.
"""

from __future__ import annotations

import asyncio
import ipaddress
import random
import re

import orjson

from extproc.policy.admission import AdmissionController
from extproc.policy.pool import PoolGate
from extproc.policy.schema import PoolLimitSpec, PoolSpec
from extproc.policy.steering import EJECT_S
from extproc.server.saturation import PoolScraper, host_port
from tests.conftest import FakeClock, limits, make_policy

INTERVAL = 0.2  # scrape_interval_ms 200
STALL_S = 2.0
STALE_S = 1.0
WINDOW_S = 100 * INTERVAL  # the pace window (PACE_SCRAPES)
DISCOVER_S = 5.0  # PoolScraper._round reads Envoy's host list this often
GIVE_UP_S = 6.0  # a client waits this long for a hung replica
ADMIN = "http://envoy-admin:9901"


class Replica:
    """A simulated vLLM: its counters, the requests it holds, and what is wrong with it."""

    def __init__(self, address: str, started: float):
        self.address = address
        self.mode = "ok"  # ok | hung | dead (refuses) | frozen (answers nothing) | erroring (5xx to requests)
        self.slow = False
        self.pace_since = self.mode_since = started  # when it last became slow or fast again, changed mode
        self.started = started
        self.tokens = 0.0
        self.itl_sum = self.itl_count = 0.0
        self.held: list[list] = []  # [request id, done at, given up]
        self.hung_since = None  # when it began holding requests with its counters still
        self.moved_at = None  # when its counters last moved

    def metrics(self) -> bytes:
        running = len(self.held)
        lines = [f'vllm:num_requests_running{{model_name="m"}} {running}',
                 'vllm:num_requests_waiting{model_name="m"} 0', 'vllm:kv_cache_usage_perc{model_name="m"} 0.1',
                 f'vllm:prompt_tokens_total{{model_name="m"}} {self.tokens}',
                 f'vllm:generation_tokens_total{{model_name="m"}} {self.tokens}',
                 f"process_start_time_seconds {self.started}",
                 f'vllm:inter_token_latency_seconds_sum{{model_name="m"}} {self.itl_sum}',
                 f'vllm:inter_token_latency_seconds_count{{model_name="m"}} {self.itl_count}']
        return ("\n".join(lines) + "\n").encode()


class Response:
    def __init__(self, status: int, body: bytes):
        self.status, self.body, self.content_length = status, body, len(body)
        self.content = self

    async def iter_chunked(self, n):
        yield self.body

    async def json(self, content_type=None):
        return orjson.loads(self.body)

    def close(self):
        pass

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False


class World:
    """The replicas, Envoy's host list per pool, and the HTTP answers the scraper gets."""

    def __init__(self):
        self.replicas: dict[str, Replica] = {}
        self.envoy: dict[str, list[str]] = {}  # pool -> its hosts, as Envoy lists them

    def get(self, url: str, timeout=None) -> Response:
        if url.startswith(ADMIN):
            doc = {"cluster_statuses": [
                {"name": pool, "host_statuses": [{"address": {"socket_address": _socket_address(a)}}
                                                 for a in hosts]} for pool, hosts in self.envoy.items()]}
            return Response(200, orjson.dumps(doc))
        address, path = re.fullmatch(r"http://([^/]+)(/.*)", url).groups()
        r = self.replicas.get(_canonical(address))
        if r is None or r.mode == "dead":
            raise ConnectionRefusedError(111, "refused")
        if r.mode == "frozen":
            raise asyncio.TimeoutError()
        if path == "/health":
            return Response(200, b"")
        if path == "/metrics":
            return Response(200, r.metrics())
        return Response(404, b"")


def _spelled(address: str) -> str:
    """As an operator may write it in the policy: an IPv6 address in full (Envoy lists it as inet_ntop writes it)."""
    host, _, port = address.rpartition(":")
    return f"[{ipaddress.ip_address(host[1:-1]).exploded}]:{port}" if host.startswith("[") else address


def _canonical(address: str) -> str:
    host, _, port = address.rpartition(":")
    return host_port(str(ipaddress.ip_address(host.strip("[]"))), port)


def _socket_address(address: str) -> dict:
    host, _, port = address.rpartition(":")
    return {"address": host.strip("[]"), "port_value": int(port)}


class Model:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.clock = FakeClock()
        classes = {"interactive": {**limits(1000, 10, 1000), "slo_p95_ms": 2000},
                   "batch": limits(1000, 10, 1000)}
        self.core = AdmissionController(make_policy(classes=classes, default_class="batch"), clock=self.clock)
        self.world = World()
        self.next_ip = 1
        self.next_id = 0
        self.gates: dict[str, PoolGate] = {}
        self.requests: dict[int, tuple[str, str, int]] = {}  # id -> (pool, replica, stall it was taken in)
        self.scrapers: dict[str, PoolScraper] = {}
        self.removed: dict[str, tuple[str, float]] = {}  # address -> the pool it was removed from, when
        self.seen: dict[str, dict] = {}  # pool -> address -> its ScrapedReplica at the last round
        self.forgotten: dict[str, dict] = {}  # pool -> address -> the ScrapedReplica it had until it was removed
        self.was_slow: dict[str, object] = {}  # address -> its ScrapedReplica, judged slow at the last round
        self.known: dict[str, tuple] = {}  # pool -> what its last round knew (remember)
        for pool, discovered in (("pool_a", False), ("pool_b", True)):
            hosts = [self.new_replica() for _ in range(self.rng.randint(2, 4))]
            self.world.envoy[pool] = hosts
            spec = self.spec(hosts, discovered)
            self.scrapers[pool] = PoolScraper(self.core, pool, spec, self.world, clock=self.clock)
            self.gates[pool] = PoolGate(pool, PoolLimitSpec(enabled=True, unit="requests"), {}, [0.0], ["c"])
            self.remember(pool)

    @staticmethod
    def spec(hosts: list[str], discovered: bool) -> PoolSpec:
        kwargs = {"envoy_admin": ADMIN} if discovered else {"replicas": [_spelled(h) for h in hosts]}
        return PoolSpec(**kwargs, scrape_interval_ms=int(INTERVAL * 1000), stale_ms=int(STALE_S * 1000),
                        stall_ms=int(STALL_S * 1000), slow_ratio=1.5)

    def new_replica(self) -> str:
        n, self.next_ip = self.next_ip, self.next_ip + 1
        address = host_port(f"fd00::{n:x}" if n % 3 == 0 else f"10.0.0.{n}", 8000)
        self.world.replicas[address] = Replica(address, started=self.clock())
        return address

    # --- events -------------------------------------------------------------------------------------------

    def event(self) -> None:
        rng, now = self.rng, self.clock()
        pool = rng.choice(list(self.scrapers))
        hosts = self.world.envoy[pool]
        r = self.world.replicas[rng.choice(hosts)]
        mode = r.mode
        self.change(r, pool, hosts, now)
        if r.mode != mode:
            r.mode_since = now

    def change(self, r: Replica, pool: str, hosts: list[str], now: float) -> None:
        rng = self.rng
        kind = rng.choice(["hang", "hang", "resume", "resume", "die", "restart", "restart", "freeze", "err", "slow",
                           "slow", "fast", "add", "remove", "readd", "reload"])
        if kind == "hang" and r.mode == "ok":
            r.mode = "hung"
        elif kind == "resume" and r.mode in ("hung", "frozen", "erroring"):
            r.mode = "ok"
        elif kind == "die" and r.mode != "dead":
            r.mode = "dead"
            self.drop(r)
        elif kind == "restart":  # a new process: counters at 0, nothing held
            self.drop(r)
            r.mode, r.started = "ok", now
            r.tokens = r.itl_sum = r.itl_count = 0.0
        elif kind == "freeze" and r.mode == "ok":
            r.mode = "frozen"
        elif kind == "err" and r.mode == "ok":
            r.mode = "erroring"
        elif kind == "slow" and not r.slow:
            r.slow, r.pace_since = True, now
        elif kind == "fast" and r.slow:
            r.slow, r.pace_since = False, now
        elif kind == "add" and len(hosts) < 5:
            self.set_hosts(pool, hosts + [self.new_replica()])
        elif kind == "remove" and len(hosts) > 2:
            self.set_hosts(pool, [h for h in hosts if h != r.address])
            self.drop(r)
            self.removed[r.address] = (pool, self.clock())
        elif kind == "readd" and len(hosts) < 5:
            back = [a for a, (p, _) in self.removed.items() if p == pool and a not in hosts]
            if back:  # a new pod at the address of one removed before
                self.world.replicas[back[0]] = Replica(back[0], started=now)
                del self.removed[back[0]]
                self.set_hosts(pool, hosts + [back[0]])
        elif kind == "reload":  # any change of the policy restarts the scrapers (SaturationScrapers)
            old = self.scrapers[pool]
            self.scrapers[pool] = PoolScraper(self.core, pool, old.spec, self.world, clock=self.clock,
                                              known=old.replicas)

    def set_hosts(self, pool: str, hosts: list[str]) -> None:
        self.world.envoy[pool] = hosts
        old = self.scrapers[pool]
        if old.spec.replicas:  # listed in the policy: a reload restarts the scraper (SaturationScrapers)
            self.scrapers[pool] = PoolScraper(self.core, pool, self.spec(hosts, False), self.world, clock=self.clock,
                                              known=old.replicas)

    # --- requests -----------------------------------------------------------------------------------------

    def send(self, pool: str) -> None:
        cls = self.rng.choice(["interactive", "batch"])
        header = self.core.replicas_for(pool, cls)
        self.check_header(pool, cls, header)
        target = self.envoy_pick(pool, header)
        if target is None:
            return
        r = self.world.replicas[target]
        rid, self.next_id = self.next_id, self.next_id + 1
        gate = self.gates[pool]
        self.requests[rid] = (pool, target, gate.take(0, 1.0))
        if r.mode == "erroring":
            self.finish(rid, failed=True)
            return
        r.held.append([rid, self.clock() + self.rng.uniform(0.2, 2.0), False])

    def envoy_pick(self, pool: str, header: str | None) -> str | None:
        hosts = self.world.envoy[pool]
        if header is not None:
            for name in header.split(","):
                if name in hosts:
                    return name  # override_host: the first named host it has, whatever its health
        healthy = [h for h in hosts if self.world.replicas[h].mode not in ("dead", "frozen")]
        if not healthy:
            return None
        return min(healthy, key=lambda h: (len(self.world.replicas[h].held), self.rng.random()))

    def drop(self, r: Replica) -> None:
        """The requests r holds end with an error (their clients still waiting), and it holds none."""
        for req in r.held:
            if not req[2]:
                self.finish(req[0], failed=True)
        r.held = []

    def finish(self, rid: int, failed: bool) -> None:
        pool, address, stall = self.requests.pop(rid)
        self.gates[pool].give_back(0, 1.0, stall=stall)
        if self.core.steering.active:  # as the access log counts answers
            self.core.replica_answered(address, failed)

    def progress(self) -> None:
        now = self.clock()
        for r in self.world.replicas.values():
            if r.mode in ("hung", "frozen"):
                for req in r.held:
                    if not req[2] and now - req[1] > GIVE_UP_S:  # the client gave up; the engine still counts it
                        req[2] = True
                        self.finish(req[0], failed=False)
                if r.held and r.hung_since is None:
                    r.hung_since = now
                continue
            r.hung_since = None
            if r.mode == "dead" or not r.held:
                continue
            step = 5.0 * len(r.held)
            r.tokens += step
            r.itl_count += step
            r.itl_sum += step * 0.01 * (2.5 if r.slow else 1.0)
            r.moved_at = now
            done = [req for req in r.held if req[1] <= now or req[2]]
            r.held = [req for req in r.held if req not in done]
            for req in done:
                if not req[2]:
                    self.finish(req[0], failed=False)

    # --- checks -------------------------------------------------------------------------------------------

    def check_header(self, pool: str, cls: str, header: str | None) -> None:
        """Judged by what the pool's last round knew (a reload or a new host list shows at the next)."""
        stalled, slow, bad, gone, working = self.known[pool]
        if not stalled and not (slow and cls == "interactive"):
            assert header is None, (pool, cls, header, "named replicas with none stalled")
            return
        if header is None:  # Envoy picks, maybe the stalled one: only when none works or all are ejected
            now = self.clock()
            assert not stalled or all(self.core.steering._ejected(a, now) for a in working), (
                pool, cls, "a stalled replica left to Envoy's balancing with a working one", working)
            return
        names = header.split(",")
        assert len(names) == len(set(names)), header
        for name in names:
            assert _envoy_form(name), (header, "not IP:PORT as Envoy lists its hosts")
        assert not set(names) & bad, (header, "names a stalled, dead or unhealthy replica", bad)
        assert not set(names) & gone, (header, "names a replica no longer in the pool", gone)
        if cls == "interactive":
            flags = [n in slow for n in names]
            assert flags == sorted(flags), (header, "a slow replica named before a fast one")

    def remember(self, pool: str) -> None:
        scraper, hosts = self.scrapers[pool], self.world.envoy[pool]
        known = scraper.replicas.values()
        fresh = self.clock() - STALE_S
        # Stalled: as the reading counts them (one that refuses connections is down, out of Envoy's pool too, once its
        # last reading is stale: its verdict is kept for its return).
        sat = self.core.saturation.get(pool)
        self.known[pool] = ({r.endpoint for r in known if r.stalled} if sat is not None and sat.stalled else set(),
                            {r.endpoint for r in known if r.pace.slow},
                            {r.endpoint for r in known if r.stalled or r.refused or not r.healthy},
                            {a for a, (p, at) in self.removed.items() if p == pool and a not in hosts
                             and (scraper.spec.replicas or at < scraper._last_discovery)},
                            {r.endpoint for r in known
                             if r.at >= fresh and r.healthy and not (r.stalled or r.refused)})

    def steady(self, sim: Replica, for_s: float = 2 * WINDOW_S) -> bool:
        """Working, at the same pace, for `for_s` (two pace windows)."""
        return sim.mode == "ok" and self.clock() - max(sim.pace_since, sim.mode_since, sim.started) > for_s

    def check_round(self) -> None:
        now = self.clock()
        for pool, scraper in self.scrapers.items():
            hosts = self.world.envoy[pool]
            listed = {_canonical(a): r for a, r in scraper.replicas.items()}
            seen, forgotten = self.seen.setdefault(pool, {}), self.forgotten.setdefault(pool, {})
            for address in set(seen) - set(listed):
                forgotten[address] = seen.pop(address)
            for address, r in listed.items():
                assert forgotten.pop(address, None) is not r, (pool, address, "a removed replica's reading came back")
                seen[address] = r
            if scraper.spec.replicas or scraper._last_discovery == now:  # a reload, or Envoy's list just read
                assert set(listed) == set(hosts), (pool, "readings of removed replicas kept")
            judged = {a: r.at == now and not r.stalled and r.pace.seconds_per_token(now) is not None
                      for a, r in listed.items()}  # its pace compared with the others' this round
            for address in set(listed) & set(hosts):
                r, sim = listed[address], self.world.replicas[address]
                readable = sim.mode not in ("dead", "frozen")
                if readable and sim.moved_at == now:
                    assert not r.stalled, (pool, address, "still stalled after its counters moved")
                steady = self.steady(sim)
                fast = [h for h in hosts if judged.get(h) and self.steady(self.world.replicas[h], WINDOW_S)
                        and not self.world.replicas[h].slow]
                if judged[address] and sim.slow and self.was_slow.get(address) is r and fast:
                    # The simulated replicas keep their pace at any load: beside a faster one judged this round, none
                    # reads near a slow one's but another slow one, which must not let it back.
                    assert r.pace.slow, (pool, address, "let back while as slow as ever")
                if steady and not sim.slow:
                    assert not r.pace.slow, (pool, address, "still slow two windows after it was not")
                if steady and sim.slow and any(self.steady(self.world.replicas[h]) and not self.world.replicas[h].slow
                                               for h in hosts):
                    assert r.pace.slow, (pool, address, "2.5x slower than another for two windows, not seen slow")
                if readable and sim.mode == "hung" and sim.held and now - sim.hung_since > STALL_S + 2 * INTERVAL:
                    assert r.stalled, (pool, address, "holds requests with still counters, not seen stalled")
            self.was_slow.update((a, r) for a, r in listed.items() if r.pace.slow)
            for a in [a for a, r in self.was_slow.items() if listed.get(a) is r and not r.pace.slow]:
                del self.was_slow[a]
            gate = self.gates[pool]
            assert -1e-9 <= gate.stuck <= gate.inflight + 1e-9, (pool, gate.stuck, gate.inflight)
            assert -1e-9 <= gate.steered <= gate.inflight + 1e-9, (pool, gate.steered, gate.inflight)
        assert set(self.core.steering._pools) <= set(self.scrapers)
        for address, (_, last) in self.core.steering._failing.items():
            assert now - last <= EJECT_S + INTERVAL, (address, "answers kept past Envoy's ejection time")

    # --- run ----------------------------------------------------------------------------------------------

    async def step(self) -> None:
        if self.rng.random() < 0.08:
            self.event()
        for pool in self.scrapers:
            for _ in range(self.rng.randint(0, 3)):
                self.send(pool)
        self.progress()
        for pool, scraper in self.scrapers.items():
            await scraper._round(self.clock())
            self.gates[pool].update(self.clock(), self.core.saturation.get(pool))
            self.remember(pool)
        self.check_round()
        self.clock.advance(INTERVAL)


def _envoy_form(name: str) -> bool:
    host, _, port = name.rpartition(":")
    if not port.isdigit():
        return False
    if host.startswith("["):
        ip = ipaddress.ip_address(host[1:-1])
        return ip.version == 6 and host == f"[{ip}]"
    try:
        return str(ipaddress.IPv4Address(host)) == host
    except ValueError:
        return False


def run(seed: int, steps: int) -> None:
    model = Model(seed)

    async def main():
        for _ in range(steps):
            await model.step()

    asyncio.run(main())


def test_steering_model():
    for seed in range(20):
        run(seed, 600)
