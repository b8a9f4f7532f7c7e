"""The server's reloads and background loops (extproc/server/main.py): a bad file or a failing round is logged
and counted, never the end of the loop or an exception out of the SIGHUP callback."""

import argparse
import asyncio
import logging
import os
import time

import pytest

from extproc.policy.schema import load_policy_bytes, load_policy_file
from extproc.server.main import Server, _every, add_arguments, worker_argv

GOOD = "classes: {interactive: {max_concurrency: 1}}\nmodels: {llama: {cluster: pool_a}}\n"


def serve(tmp_path) -> Server:
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return Server(str(path), load_policy_file(str(path)), parser.parse_args(["--policy", str(path)]))


def reloads(server: Server, result: str) -> float:
    return server.telemetry.registry.get_sample_value("extproc_config_reload_total", {"result": result})


def test_a_policy_file_changed_to_latin1_is_a_refused_reload_and_the_old_policy_stays(tmp_path, caplog):
    server = serve(tmp_path)
    before = server.core.policy
    path = tmp_path / "policy.yaml"
    path.write_bytes(GOOD.replace("llama", "caf\u00e9").encode("latin-1"))
    os.utime(path, (1, 1))  # a change the file watch sees, however coarse the file system's clock

    async def watch_round() -> None:
        await server.housekeep()  # the watch's round: it used to raise UnicodeDecodeError and end the loop
        await asyncio.gather(*server._reload_tasks)

    asyncio.run(watch_round())
    assert reloads(server, "invalid") == 1 and not reloads(server, "applied")
    assert server.core.policy is before
    assert "not valid UTF-8: byte 0xe9" in caplog.text


def test_a_reload_that_fails_unexpectedly_is_logged_counted_and_does_not_raise(tmp_path, caplog, monkeypatch):
    server = serve(tmp_path)

    def broken(policy):
        raise RuntimeError("injected")

    monkeypatch.setattr(server.core, "apply", broken)

    async def sighup() -> bool:
        return await server.reload()  # what the SIGHUP callback's task runs

    assert asyncio.run(sighup()) is False
    assert reloads(server, "invalid") == 1
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert record.exc_info is not None and "injected" in caplog.text


def test_a_failed_background_round_is_logged_with_its_traceback_and_the_next_round_runs(caplog):
    rounds = []

    async def step() -> None:
        rounds.append(1)
        if len(rounds) == 1:
            raise RuntimeError("injected")

    async def run_rounds() -> None:
        loop = asyncio.create_task(_every(0.001, step, "housekeeping"))
        while len(rounds) < 3:
            await asyncio.sleep(0.001)
        loop.cancel()

    asyncio.run(asyncio.wait_for(run_rounds(), 5))
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert record.getMessage() == "housekeeping failed; it runs again in 0.001 s"
    assert record.exc_info is not None


@pytest.mark.timing  # gaps of the event loop: beside four busy workers on two cores, one read 0.97 s (CI, stop 57)
def test_a_slow_reload_leaves_the_event_loop_serving(tmp_path, monkeypatch):
    """Found by reloading a 1.7 MB policy (20,000 tenants, 10 s of YAML) under load through the real stack: the
    reload ran on the event loop, every admission waited for it, and past Envoy's 0.5 s message_timeout
    failure_mode_allow sent 22 of 83 requests upstream unadmitted. The file is now read in a thread."""
    server = serve(tmp_path)

    def slow_load(path, raw):
        end = time.monotonic() + 1.0
        while time.monotonic() < end:  # CPU-bound, as parsing is: the loop gets its turns only by the GIL's switch
            pass
        return load_policy_bytes(path, raw)

    monkeypatch.setattr("extproc.server.main.load_policy_bytes", slow_load)

    async def run() -> float:
        gaps, last = [], time.monotonic()
        server.start_reload()  # as the SIGHUP callback does
        while server._reload_tasks:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now
        return max(gaps)

    assert asyncio.run(run()) < 0.5
    assert reloads(server, "applied") == 1


def test_a_store_change_waits_for_a_restart_and_the_running_store_stays_in_force(tmp_path, caplog):
    """Found by editing `store` live: the reload warned that store changes apply on restart, yet installed the
    file's `store` as the running policy's - so the reload line listed it as changed, a second reload said
    nothing though the restart was still due, reverting the file warned of a change that restored the running
    store, and extproc_class_limit{scope} (read from the policy's store.kind) would name a store not running."""
    caplog.set_level(logging.INFO)
    server = serve(tmp_path)
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD + "store: {kind: redis, url: 'redis://:hunter2@10.0.0.9:6379/0'}\n")

    async def reload() -> bool:
        return await server.reload()

    assert asyncio.run(reload())
    assert server.core.policy.store.kind == "memory"  # what runs
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["policy reload: `store` differs from the running store (store.kind 'memory' -> 'redis'; "
                        "store.url changed); it applies on restart, the running store stays"]
    assert "reloaded from" in caplog.text and "hunter2" not in caplog.text
    (line,) = [r.getMessage() for r in caplog.records if "reloaded from" in r.getMessage()]
    assert line.endswith(": no change")  # what is in force did not change
    caplog.clear()
    assert asyncio.run(reload())  # still due: said again
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    caplog.clear()
    path.write_text(GOOD)
    assert asyncio.run(reload())
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_a_reload_logs_what_extproc_check_would_warn_about(tmp_path, caplog):
    """Found by editing a policy live: `slo_p95_ms: 2` (meant as 2 s) applied without a word - `extproc check` warns
    that the SLO is in milliseconds, but the server never said its warnings, at start or on reload."""
    server = serve(tmp_path)
    (tmp_path / "policy.yaml").write_text(GOOD.replace("max_concurrency: 1", "max_concurrency: 1, slo_p95_ms: 2"))

    async def reload() -> bool:
        return await server.reload()

    assert asyncio.run(reload())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["policy warning: classes.interactive.slo_p95_ms: 2 ms; the SLO is in milliseconds (2000 for "
                        "2 s)"]


def test_an_ipv6_metrics_address_in_brackets_is_listened_on_and_passed_on_to_the_workers(tmp_path):
    """`--metrics [::1]:9090` (as an IPv6-only cluster writes an address) used to reach aiohttp with its brackets:
    the name did not resolve and the server refused to start; gRPC takes the bracketed form."""
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--policy", str(path), "--grpc", "[::1]:50051", "--metrics", "[::1]:0"])
    server = Server(str(path), load_policy_file(str(path)), args)

    async def listen() -> None:
        runner = await server._start_http()
        await runner.cleanup()

    asyncio.run(listen())
    argv = worker_argv(args, 1)
    assert argv[argv.index("--grpc") + 1] == "[::1]:50052" and argv[argv.index("--metrics") + 1] == "[::1]:1"


def serve_main(monkeypatch, path, parse, run) -> None:
    """`extproc serve --policy path` (main.run) with its parse (load_policy_bytes) and Server.run replaced."""
    from extproc.server import main

    monkeypatch.setattr(main, "load_policy_bytes", parse)
    monkeypatch.setattr(Server, "run", run)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert main.run(parser.parse_args(["--policy", str(path), "--no-uvloop"])) == 0


def test_a_policy_file_edited_while_serve_loads_it_is_reloaded_once_it_serves(tmp_path, monkeypatch):
    """SIGHUP is ignored while `extproc serve` starts, on the promise that a file changed meanwhile is reloaded
    once it serves. The file's time was read after the load, when the server was built: an edit that landed
    during the load (a big policy takes seconds) counted as loaded, and the old policy ran until the next edit."""
    from extproc.server import main

    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    os.utime(path, (1, 1))
    real_load = main.load_policy_bytes
    edits = []

    def load_then_edit(p: str, raw: bytes):
        policy = real_load(p, raw)
        if not edits:  # the operator's edit lands while the first load runs
            edits.append(1)
            path.write_text(GOOD.replace("max_concurrency: 1", "max_concurrency: 2"))
            os.utime(path, (2, 2))
        return policy

    async def serve_one_round(self: Server) -> None:  # Server.run, down to one round of the file watch
        await self.housekeep()
        await asyncio.gather(*self._reload_tasks)
        served.append(self.core.policy.classes["interactive"].max_concurrency)

    served = []
    serve_main(monkeypatch, path, load_then_edit, serve_one_round)
    assert served == [2]


def test_a_sighup_right_after_start_for_the_file_serve_loaded_does_not_parse_it_again(tmp_path, monkeypatch):
    """A reload remembers the digest of the file it applied (Server._parsed): the same bytes again are not
    parsed. The file `serve` loaded at start was not remembered, so the first SIGHUP after start (a config
    manager's "to be sure") parsed it again: a 2,000-tenant file holds the GIL 0.65-1.3 s."""
    from extproc.server import main

    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    parses = []
    real_parse = main.load_policy_bytes

    def counted(p: str, raw: bytes):
        parses.append(p)
        return real_parse(p, raw)

    async def reload_once(self: Server) -> None:  # Server.run, down to one SIGHUP
        at_start = len(parses)
        self.start_reload()
        await asyncio.gather(*self._reload_tasks)
        reloaded.append(len(parses) - at_start)

    reloaded = []
    serve_main(monkeypatch, path, counted, reload_once)
    assert reloaded == [0]


def test_a_policy_file_replaced_with_the_same_modification_time_is_still_reloaded(tmp_path):
    """The watch compared the file's modification time alone: a file put in place keeping its source's time
    (`cp -p`, `rsync -t`, `docker cp`, shutil.copy2 and a rename) or rewritten within one tick of a filesystem
    with coarse timestamps, when that time equals the loaded one, was never reloaded, without a line of log, and
    `extproc_config_last_reload_successful` still said 1. Any change of the file's identity, size or times counts."""
    server = serve(tmp_path)
    path = tmp_path / "policy.yaml"
    loaded = os.stat(path)

    def put(text: str, rename: bool) -> None:
        target = path.with_suffix(".new") if rename else path
        target.write_text(text)
        os.utime(target, ns=(loaded.st_atime_ns, loaded.st_mtime_ns))  # the loaded file's time, to the ns
        if rename:
            os.replace(target, path)

    async def watch_round() -> int:
        server._watched_at = -float("inf")  # the interval has passed
        await server.housekeep()
        await asyncio.gather(*server._reload_tasks)
        return server.core.policy.classes["interactive"].max_concurrency

    async def run() -> list[int]:
        seen = [await watch_round()]
        put(GOOD.replace("max_concurrency: 1", "max_concurrency: 2"), rename=True)  # cp -p, then mv
        seen.append(await watch_round())
        put(GOOD.replace("max_concurrency: 1", "max_concurrency: 30"), rename=False)  # in place, one size more
        seen.append(await watch_round())
        seen.append(await watch_round())  # no change since: no reload
        return seen

    assert asyncio.run(run()) == [1, 2, 30, 30]
    assert reloads(server, "applied") == 2


def test_a_policy_file_change_is_picked_up_while_another_housekeeping_step_keeps_failing(tmp_path):
    """The watch ran last in the housekeeping round: a step before it that raised every round (lease renewal,
    reaping, the shared store's tick) left file edits unapplied for as long as it failed."""
    server = serve(tmp_path)
    path = tmp_path / "policy.yaml"

    def broken() -> None:
        raise RuntimeError("renewal failed")

    server.servicer.renew_live = broken

    async def run() -> int:
        path.write_text(GOOD.replace("max_concurrency: 1", "max_concurrency: 7"))
        server._watched_at = -float("inf")  # the interval has passed
        with pytest.raises(RuntimeError):
            await server.housekeep()
        await asyncio.gather(*server._reload_tasks)
        return server.core.policy.classes["interactive"].max_concurrency

    assert asyncio.run(run()) == 7


class HeldParse:
    """load_policy_bytes held in its thread until released: what a big file's parse is to the asks that come
    meanwhile. Counts the parses."""

    def __init__(self, monkeypatch) -> None:
        import threading

        self.parses, self.started, self.release = 0, threading.Event(), threading.Event()
        monkeypatch.setattr("extproc.server.main.load_policy_bytes", self.parse)

    def parse(self, path, raw):
        self.parses += 1
        self.started.set()
        assert self.release.wait(10)
        return load_policy_bytes(path, raw)

    async def running(self) -> None:
        deadline = time.monotonic() + 10
        while not self.started.is_set():
            assert time.monotonic() < deadline, "no parse started"
            await asyncio.sleep(0.001)
        self.started.clear()


def test_a_storm_of_sighups_for_an_unchanged_file_parses_it_once(tmp_path, monkeypatch):
    """Each SIGHUP queued a reload of its own, each parsing the file in turn: with 2,000 tenants a parse takes
    0.65 s, holding the GIL (the event loop's steps stretched to 50 ms and more meanwhile), so a storm of 100,
    one every 0.2 s, kept the server parsing for a minute after the last. Asks that come while a reload waits for
    its turn are that reload; a file byte for byte the one applied last is not parsed again."""
    server = serve(tmp_path)
    held = HeldParse(monkeypatch)

    async def storm() -> None:
        server.start_reload()  # as the SIGHUP callback does
        await held.running()
        for _ in range(50):  # the storm, while the first reload parses
            server.start_reload()
            await asyncio.sleep(0)
        held.release.set()
        while server._reload_tasks:
            await asyncio.gather(*server._reload_tasks)
        for _ in range(5):  # after it, one at a time: the file is the one applied
            server.start_reload()
            await asyncio.gather(*server._reload_tasks)

    asyncio.run(storm())
    assert held.parses == 1
    assert reloads(server, "applied") == 2 + 5 and not reloads(server, "invalid")


def test_the_last_edit_of_a_storm_is_the_one_applied_and_a_file_put_back_after_a_refused_one_applies(tmp_path,
                                                                                                     monkeypatch):
    """Coalesced asks must not lose an edit: a reload that waits reads the file when its turn comes, after every
    edit signalled so far. The applied file put back after a refused one is a successful reload again (its
    parse remembered)."""
    server = serve(tmp_path)
    path = tmp_path / "policy.yaml"
    held = HeldParse(monkeypatch)

    def cap() -> int:
        return server.core.policy.classes["interactive"].max_concurrency

    async def storm() -> list[int]:
        seen = []
        path.write_text(GOOD.replace("max_concurrency: 1", "max_concurrency: 2"))
        server.start_reload()
        await held.running()
        for n in range(3, 13):  # edits, each signalled, while the first one parses
            path.write_text(GOOD.replace("max_concurrency: 1", f"max_concurrency: {n}"))
            server.start_reload()
            await asyncio.sleep(0)
        held.release.set()
        while server._reload_tasks:
            await asyncio.gather(*server._reload_tasks)
        seen.append(cap())
        applied = path.read_text()
        path.write_text("classes: {interactive: {max_concurrency: -1}}\nmodels: {}\n")
        assert not await server.reload()
        path.write_text(applied)  # back to the applied file
        assert await server.reload()
        seen.append(cap())
        return seen

    assert asyncio.run(storm()) == [12, 12]
    assert held.parses == 3  # 2, 12, the refused file
    assert reloads(server, "applied") == 3 and reloads(server, "invalid") == 1
    ms = server.telemetry.registry.get_sample_value("extproc_config_last_reload_successful")
    assert ms == 1


def test_a_big_policy_file_is_parsed_in_a_child_process_to_the_same_policy_and_errors(tmp_path, monkeypatch,
                                                                                        caplog):
    """Parsed in a thread of the server's, a 2,000-tenant file (0.65 s of YAML, more on a busy host) held the GIL
    all along; the event loop got it back only every switch interval each time it let go of it, its steps
    stretched to 0.15-0.9 s, and answers came past Envoy's 0.5 s message_timeout. A big file is parsed in a child
    process: the same policy, the same errors; if the child fails, in the thread as before."""
    from extproc.server import main

    server = serve(tmp_path)
    path = tmp_path / "policy.yaml"
    tenants = "".join(f"  - {{name: tenant-{i}, api_keys: [sk-{i:06d}], max_class: interactive}}\n" for i in range(600))
    big = GOOD + "tenants:\n" + tenants
    assert len(big) > main.PARSE_APART_BYTES
    path.write_text(big)

    def here(path, raw):
        raise AssertionError("parsed in the server's process")

    async def reload() -> bool:
        return await server.reload()

    monkeypatch.setattr(main, "load_policy_bytes", here)
    assert asyncio.run(reload())
    assert server.core.policy == load_policy_file(str(path)) and len(server.core.policy.tenants) == 600

    path.write_text(big.replace("max_concurrency: 1", "max_concurrency: -1") + "  - {name: tenant-1, api_keys: [x]}\n")
    with pytest.raises(Exception) as refused:
        load_policy_file(str(path))
    assert not asyncio.run(reload())
    assert "\n  ".join(refused.value.errors) in caplog.text and reloads(server, "invalid") == 1

    monkeypatch.undo()
    monkeypatch.setattr(main.sys, "executable", str(tmp_path / "no-python"))
    path.write_text(big.replace("max_concurrency: 1", "max_concurrency: 4"))
    assert asyncio.run(reload())
    assert server.core.policy.classes["interactive"].max_concurrency == 4
    assert "in a child process failed" in caplog.text


def test_a_sighup_for_an_unchanged_file_still_restarts_what_a_reload_restarts(tmp_path, monkeypatch):
    """docs/troubleshooting.md: a saturation scraper that stopped is restarted by a reload (SIGHUP), and a reload
    names a missing cluster again. A file byte for byte the one applied last is not parsed nor applied again, but
    the scrapers and the cluster check are still reconfigured for the policy in force."""
    server = serve(tmp_path)
    configured = []

    async def scrapers(pools):
        configured.append(("scrapers", pools))

    async def clusters(policy):
        configured.append(("clusters", policy))

    monkeypatch.setattr(server.scrapers, "configure", scrapers)
    monkeypatch.setattr(server.clusters, "configure", clusters)

    async def two_sighups() -> None:
        for _ in range(2):  # the first parses and applies; the second finds the same bytes
            server.start_reload()
            while server._reload_tasks:
                await asyncio.gather(*server._reload_tasks)

    asyncio.run(two_sighups())
    policy = server.core.policy
    assert configured == [("scrapers", policy.pools), ("clusters", policy)] * 2
    assert reloads(server, "applied") == 2
