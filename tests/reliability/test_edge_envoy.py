"""No way around admission, through real Envoy: whatever a client does with the path, its keys or its body, a
request that reaches a replica has been admitted (it carries the ext_proc's ticket), and everything else gets an
OpenAI-style refusal. The threat model and the tables are in docs/reliability.md."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from extproc.server.openai import ENDPOINTS, MAX_JSON_DEPTH
from extproc.tools.envoyconf import load_source
from tests.conftest import policy_file, until
from tests.integration.helpers import (chat, metrics, post, raw_request, sample, upstream_reset, upstream_stats,
                                       wait_idle)

ALL_ENDPOINTS = {"responses": True, "invocations": True, "embeddings": True, "tokenize": True}
CT = (b"content-type", b"application/json")


def spellings(path: str) -> list[str]:
    """The ways a client may write `path` that a decoding server (vLLM's) could still serve as `path`."""
    head, _, last = path.rpartition("/")
    first = last[0]
    return [
        path,
        f"{head}/%{ord(first):02X}{last[1:]}",                 # an escaped letter
        f"{head}/%{ord(first):02x}{last[1:]}",                 # ... in lower-case hex
        f"{head}%2F{last}", f"{head}%2f{last}",               # an escaped slash
        f"{head}%5C{last}",                                   # an escaped backslash
        path.replace("/", "//"),                              # doubled slashes
        "/" + path,
        f"/v1/./{path.removeprefix('/v1/')}" if path.startswith("/v1/") else f"/./{path[1:]}",
        f"/x/..{path}",                                       # dot segments
        f"/x/%2E%2E{path}",                                   # escaped dot segments
        path.upper(),                                         # case
        path + "/",                                           # trailing slash
        path + "?stream=true",                                # a query
        path + ";x",                                          # a path parameter
        path.replace("/", "%2F"),                             # every slash escaped
    ]


def body_for(path: str) -> dict:
    if ENDPOINTS[path].kind == "input":
        return {"model": "llama-70b", "input": "hello"}
    if ENDPOINTS[path].kind == "responses":
        return {"model": "llama-70b", "input": "hello", "max_output_tokens": 4}
    return chat()


@pytest.fixture
async def stack(make_stack, tmp_path):
    return make_stack(policy_file(tmp_path, endpoints=ALL_ENDPOINTS))


async def test_no_spelling_of_a_compute_path_reaches_a_replica_unadmitted(stack, upstream):
    """Before: the routes matched raw paths exactly and `prefix: /` forwarded the rest without the ext_proc, so
    /v1/chat%2Fcompletions or /v1/chat/%63ompletions ran on the replica unadmitted."""
    outcomes = {}
    async with aiohttp.ClientSession() as http:
        await upstream_reset(http, upstream)
        for path in ENDPOINTS:
            body = json.dumps(body_for(path)).encode()
            for spelled in spellings(path):
                status, headers, text = await raw_request(stack.listen_port, [CT], body, path=spelled.encode())
                decided = "x-extproc-decision" in headers
                if not decided:  # the edge's 404, or Envoy's 400 for a path that is not one; never a replica's
                    code = json.loads(text)["error"]["code"]
                    assert (status, code) in ((404, "unknown_url"), (400, "http1.codec_error")), (spelled, text)
                outcomes[spelled] = (status, decided)
        seen = await (await http.get(f"http://{upstream[0]}:{upstream[1]}/test/seen")).json()
    unadmitted = [r for r in seen if not r["ticket"] and r["path"] != "/health"]  # Envoy's health checks
    assert unadmitted == [], unadmitted
    print("\nEDGE spellings of /v1/chat/completions:\n" + "\n".join(
        f"  {p}: {st} {'through the ext_proc' if d else 'refused at the edge'}"
        for p, (st, d) in outcomes.items() if p in spellings("/v1/chat/completions")))
    # Normalisation made the decodable spellings the endpoint itself (admitted, or refused by the ext_proc).
    for path in ENDPOINTS:
        head, _, last = path.rpartition("/")
        for spelled in ([f"{head}%2F{last}"] if head else []) + [path.replace("/", "//"), f"/x/..{path}"]:
            assert outcomes[spelled][1], (spelled, outcomes[spelled])


async def test_every_method_and_unknown_path_is_refused_at_the_edge_and_read_only_gets_pass(stack, upstream):
    async with aiohttp.ClientSession() as http:
        await upstream_reset(http, upstream)
        for method, path, status in [(b"GET", b"/v1/chat/completions", 405), (b"PUT", b"/v1/completions", 405),
                                     (b"POST", b"/v1/models", 404), (b"POST", b"/health", 404),
                                     (b"GET", b"/metrics", 404), (b"POST", b"/v1/files", 404),
                                     (b"POST", b"/v1/audio/transcriptions", 404),
                                     (b"POST", b"/reset_prefix_cache", 404), (b"GET", b"/", 404),
                                     # compute paths of vLLM 0.32 (its /openapi.json) that ENDPOINTS does not
                                     # admit: refused here rather than run unadmitted
                                     (b"POST", b"/v1/messages", 404), (b"POST", b"/v1/messages/count_tokens", 404),
                                     (b"POST", b"/v1/chat/completions/batch", 404),
                                     (b"POST", b"/generative_scoring", 404),
                                     (b"POST", b"/v1/responses/resp_1/cancel", 404),
                                     # refused by Envoy before any route, its own body empty: we say why
                                     (b"POST", b"/v1/chat/completions#x", 400),
                                     (b"POST", b"/v1/chat/completions%00", 400), (b"OPTIONS", b"*", 404)]:
            got, headers, text = await raw_request(stack.listen_port, [CT], b"{}", method=method, path=path)
            assert got == status, (method, path, got, text)
            assert headers["content-type"] == "application/json", (path, headers)
            err = json.loads(text)["error"]
            assert err["message"] and err["type"] == "invalid_request_error", (path, err)
        for path in (b"/v1/models", b"/health"):
            got, _, _ = await raw_request(stack.listen_port, [], b"", method=b"GET", path=path)
            assert got == 200, path
        seen = await (await http.get(f"http://{upstream[0]}:{upstream[1]}/test/seen")).json()
    assert {r["path"] for r in seen} == {"/health"}, seen  # the ext_proc answers GET /v1/models itself


def test_envoy_routes_every_compute_endpoint_the_ext_proc_knows_and_no_other():
    """envoy.yaml's list and extproc.server.openai.ENDPOINTS must not drift apart."""
    hcm = load_source()["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    through_extproc = {r["match"]["path"] for r in routes
                       if "path" in r["match"] and "route" in r and "typed_per_filter_config" not in r}
    # And GET /v1/models, which the ext_proc answers itself (GET only; /v1/models/{id} on a prefix route).
    assert through_extproc == set(ENDPOINTS) | {"/v1/models"}
    listing = [r for r in routes if r["match"].get("path") == "/v1/models" or r["match"].get("prefix") == "/v1/models/"]
    assert len(listing) == 2 and all(r["match"]["headers"][0]["string_match"] == {"exact": "GET"} for r in listing)
    assert routes[-1]["match"] == {"prefix": "/"} and routes[-1]["direct_response"]["status"] == 404
    assert hcm["normalize_path"] and hcm["merge_slashes"]
    assert hcm["path_with_escaped_slashes_action"] == "UNESCAPE_AND_FORWARD"


async def test_switched_off_endpoints_are_refused_with_404_not_passed(make_stack, tmp_path, upstream):
    s = make_stack(policy_file(tmp_path))  # the default: embeddings and tokenize off
    async with aiohttp.ClientSession() as http:
        await upstream_reset(http, upstream)
        for path in (b"/v1/embeddings", b"/v2/rerank", b"/tokenize"):
            got, headers, text = await raw_request(s.listen_port, [CT], b'{"model": "llama-70b", "input": "x"}',
                                                   path=path)
            assert got == 404 and json.loads(text)["error"]["code"] == "unsupported_endpoint", (path, text)
        got, _, text = await raw_request(s.listen_port, [CT], b'{"model": "llama-70b", "input": "x"}',
                                         path=b"/invocations")
        assert got == 404 and json.loads(text)["error"]["code"] == "unsupported_endpoint", text
        assert (await upstream_stats(http, upstream))["served"] == 0


async def test_client_sent_extproc_and_ratelimit_headers_never_reach_the_upstream(stack, upstream):
    async with aiohttp.ClientSession() as http:
        await upstream_reset(http, upstream)
        forged = {"x-extproc-reason": "ok", "x-extproc-anything": "1", "X-ExtProc-Cluster": "vllm_llama8b",
                  "x-extproc-ticket": "1", "x-ratelimit-remaining-tokens": "999999", "X-Vllm-Priority": "-100",
                  "X-Data-Parallel-Rank": "0"}
        status, headers, _ = await post(http, stack.url, chat(), forged)
        assert status == 200
        assert headers.get("x-ratelimit-remaining-tokens") is None
        received = (await upstream_stats(http, upstream))["last_headers"]
    ours = {k.lower() for k in received if k.lower().startswith(("x-extproc-", "x-ratelimit-"))}
    # Only what the ext_proc itself set (the pool, class, decision and its ticket) arrives.
    assert ours <= {"x-extproc-cluster", "x-extproc-class", "x-extproc-decision", "x-extproc-ticket"}, ours
    assert "x-extproc-reason" not in ours and "x-extproc-anything" not in ours
    assert "x-vllm-priority" not in {k.lower() for k in received}  # vLLM would take it over the body's priority
    assert "x-data-parallel-rank" not in {k.lower() for k in received}  # nor pick the engine's data-parallel rank


# --- keys ---------------------------------------------------------------------------------------------------------

KEYS_POLICY = dict(tenants=[{"name": "acme", "api_keys": ["sk-acme-1"], "max_class": "batch",
                             "default_class": "batch"},
                            {"name": "chat", "api_keys": ["sk-chat-1"], "max_class": "interactive"}],
                   anonymous={})  # the schema's defaults, as a policy without an `anonymous:` block gets


@pytest.mark.parametrize("case,headers,status,cls", [
    ("no key", [], 200, "internal"),
    ("unknown key", [(b"authorization", b"Bearer sk-nobody")], 200, "internal"),
    ("Basic auth", [(b"authorization", b"Basic c2stYWNtZS0xOg==")], 200, "internal"),
    ("key in api-key", [(b"api-key", b"sk-acme-1")], 200, "batch"),
    ("key in Bearer", [(b"authorization", b"Bearer sk-acme-1")], 200, "batch"),
    ("same key twice", [(b"authorization", b"Bearer sk-acme-1"), (b"api-key", b"sk-acme-1")], 200, "batch"),
    ("two Authorization (acme, chat)", [(b"authorization", b"Bearer sk-acme-1"),
                                        (b"authorization", b"Bearer sk-chat-1")], 401, None),
    ("Bearer and api-key differ", [(b"authorization", b"Bearer sk-acme-1"), (b"api-key", b"sk-chat-1")], 401,
     None),
    ("acme's key and an unknown one", [(b"authorization", b"Bearer sk-acme-1"),
                                       (b"authorization", b"Bearer sk-nobody")], 401, None),
])
async def test_a_key_cannot_be_dropped_doubled_or_hidden_to_raise_a_class(make_stack, tmp_path, case, headers,
                                                                          status, cls):
    """Before: the anonymous default was the highest class, so a tenant capped at batch got interactive by
    dropping its key, mangling it, or sending it where it was not read."""
    s = make_stack(policy_file(tmp_path, **KEYS_POLICY))
    got, hs, text = await raw_request(s.listen_port, [CT, (b"x-priority", b"interactive"), *headers],
                                      json.dumps(chat()).encode())
    assert got == status, (case, text)
    if cls is not None:
        assert hs["x-extproc-class"] == cls, case
    else:
        assert json.loads(text)["error"]["code"] == "conflicting_api_keys"


async def test_a_policy_can_refuse_missing_and_unknown_keys_with_401(make_stack, tmp_path, upstream):
    s = make_stack(policy_file(tmp_path, **{**KEYS_POLICY, "anonymous": {"allow": False}}))
    async with aiohttp.ClientSession() as http:
        await upstream_reset(http, upstream)
        for headers, code in [({}, "missing_api_key"), ({"authorization": "Bearer sk-nobody"}, "invalid_api_key"),
                              ({"authorization": "Basic c2stYWNtZS0xOg=="}, "missing_api_key")]:
            status, _, body = await post(http, s.url, chat(), headers)
            assert status == 401 and json.loads(body)["error"]["code"] == code, (headers, body)
            assert b"sk-nobody" not in body
        status, _, _ = await post(http, s.url, chat(), {"api-key": "sk-acme-1"})
        assert status == 200
        assert (await upstream_stats(http, upstream))["served"] == 1


async def test_anonymous_callers_share_a_rate_limit(make_stack, tmp_path):
    s = make_stack(policy_file(tmp_path, anonymous={"requests_per_minute": 60, "burst_s": 2}))
    async with aiohttp.ClientSession() as http:
        codes = [(await post(http, s.url, chat()))[0] for _ in range(4)]
        assert codes[:2] == [200, 200] and 429 in codes[2:], codes
        status, headers, body = await post(http, s.url, chat(), {"authorization": "Bearer sk-nobody"})
        assert status == 429 and json.loads(body)["error"]["code"] == "tenant_requests_per_minute"
        assert int(headers["retry-after"]) >= 1


# --- bodies -------------------------------------------------------------------------------------------------------

def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return chat(tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}])


@pytest.mark.parametrize("case,body,status,code", [
    ("5,000 nested arrays", b'{"model": "llama-70b", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400,
     "invalid_json"),
    ("nesting past the limit", b'{"model": "llama-70b", "x": ' + b"[" * (MAX_JSON_DEPTH + 5) +
     b"]" * (MAX_JSON_DEPTH + 5) + b"}", 400, "json_too_deep"),
    ("a deep tools[].function.parameters", json.dumps(nested(400)).encode(), 400, "json_too_deep"),
    ("a tool schema just past the limit", json.dumps(nested(MAX_JSON_DEPTH)).encode(), 400, "json_too_deep"),
    ("30,000 empty arrays (a parse that stalled the loop past message_timeout)",
     b'{"model": "llama-70b", "messages": [' + b",".join([b"[]"] * 30000) + b"]}", 400, "json_too_many_containers"),
    ("30,000 brackets inside a prompt are text", json.dumps(chat(messages=[{"role": "user", "content": "[{" * 15000}]
                                                                 )).encode(), 200, None),
    ("messages: a string", json.dumps(chat(messages="hi")).encode(), 400, "messages"),  # vLLM's 400 too
    ("n: \"many\"", json.dumps(chat(n="many")).encode(), 400, "n"),
    ("n: 0", json.dumps(chat(n=0)).encode(), 400, "n"),
    ("max_tokens: 1e400", b'{"model": "llama-70b", "max_tokens": 1e400}', 400, "invalid_json"),
    ("model: {}", b'{"model": {}}', 400, "model"),
    ("NaN", b'{"model": "llama-70b", "temperature": NaN}', 400, "invalid_json"),
    ("an ordinary tool schema", json.dumps(nested(12)).encode(), 200, None),
])
async def test_body_tricks_get_a_400_from_us_never_a_stream_error(make_stack, tmp_path, upstream, case, body,
                                                                 status, code):
    """Before: a deeply nested body raised RecursionError in the parser or the prompt-size walk, the gRPC stream
    failed, and Envoy's failure_mode_allow let the request through unadmitted."""
    s = make_stack(policy_file(tmp_path))
    async with aiohttp.ClientSession() as http:
        await upstream_reset(http, upstream)
        got, headers, text = await raw_request(s.listen_port, [CT], body)
        assert got == status, (case, text[:300])
        if code is not None:
            err = json.loads(text)["error"]
            assert code in (err["code"], err["param"]), (case, err)
            assert (await upstream_stats(http, upstream))["served"] == 0
        else:
            assert "x-extproc-ticket" in (await upstream_stats(http, upstream))["last_headers"]
        await wait_idle(http, s.metrics_url)
        assert sample(await metrics(http, s.metrics_url), "extproc_stream_errors_total") == 0


async def test_the_bodys_priority_is_ours_to_strip_or_set(make_stack, tmp_path, upstream):
    classes = {"interactive": {"max_concurrency": 3, "vllm_priority": 0},
               "batch": {"max_concurrency": 3}}
    s = make_stack(policy_file(tmp_path, classes=classes, default_class="interactive"))
    async with aiohttp.ClientSession() as http:
        await post(http, s.url, chat(priority=-1000))
        assert (await upstream_stats(http, upstream))["last_body"]["priority"] == 0
        await post(http, s.url, chat(priority=-1000), {"x-priority": "batch"})
        assert "priority" not in (await upstream_stats(http, upstream))["last_body"]


# --- accounting ---------------------------------------------------------------------------------------------------

async def test_tokens_per_minute_refunds_unused_max_tokens_on_every_non_streamed_answer(make_stack, tmp_path):
    """Before: only the sampled `learn_sample` share was read, so a tenant asking max_tokens=4,000 and using 4
    was throttled as if it used 4,000."""
    tenants = [{"name": "acme", "api_keys": ["sk-acme-1"], "max_class": "interactive",
                "tokens_per_minute": 6000, "burst_s": 60}]
    s = make_stack(policy_file(tmp_path, tenants=tenants, learn_sample=0))
    key = {"authorization": "Bearer sk-acme-1"}
    async with aiohttp.ClientSession() as http:
        for i in range(6):  # 6 x 4,000 charged up front is 4x the bucket; 6 x ~9 used is nothing
            status, headers, body = await post(http, s.url, chat(max_tokens=4000), {**key, "x-test-tokens": "4"})
            assert status == 200, (i, body)

            async def refunded():
                _, hs, _ = await post(http, s.url, chat(max_tokens=1), key)
                return int(hs["x-ratelimit-remaining-tokens"]) > 5000
            await until(refunded, timeout=5)


async def test_every_429_and_503_we_send_has_an_honest_retry_after(make_stack, tmp_path):
    tenants = [{"name": "acme", "api_keys": ["sk-acme-1"], "max_class": "interactive",
                "tokens_per_minute": 60, "burst_s": 60}]
    classes = {"interactive": {"max_concurrency": 1, "max_queue": 0, "max_wait_ms": 0,
                               "on_overflow": "fallback", "fallback": {"action": "canned", "status": 503}}}
    s = make_stack(policy_file(tmp_path, tenants=tenants, classes=classes, default_class="interactive",
                               retry_after_max_s=5))
    async with aiohttp.ClientSession() as http:
        # ~100 tokens over on a 1 token/s bucket holding 60: ~100 s, whatever retry_after_max_s says.
        acme = {"authorization": "Bearer sk-acme-1"}
        assert (await post(http, s.url, chat(max_tokens=100), acme))[0] == 200  # a full bucket takes it
        status, headers, body = await post(http, s.url, chat(max_tokens=100), acme)
        assert status == 429, body
        assert int(headers["retry-after"]) >= 100, headers
        assert f"retry in {headers['retry-after']} s" in json.loads(body)["error"]["message"]
        # The canned fallback's 503 carries one too.
        first = asyncio.ensure_future(post(http, s.url, chat(), {"x-test-delay-ms": "1500"}))
        await until(lambda: _inflight(http, s.metrics_url), timeout=5)
        status, headers, body = await post(http, s.url, chat())
        await first
        assert status == 503 and int(headers["retry-after"]) >= 1, (headers, body)


async def _inflight(http, metrics_url) -> bool:
    ms = await metrics(http, metrics_url)
    return sample(ms, "extproc_inflight", **{"class": "interactive"}) >= 1



async def test_a_client_that_trickles_its_headers_is_cut_with_a_json_408(stack, upstream):
    """A byte now and then never looks idle to stream_idle_timeout (300 s): envoy.yaml's request_headers_timeout
    (10 s) cuts such a client, with an OpenAI-style body, and nothing reaches a replica."""
    async with aiohttp.ClientSession() as http:
        await upstream_reset(http, upstream)
    reader, writer = await asyncio.open_connection("127.0.0.1", stack.listen_port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: test\r\n")
    started = asyncio.get_running_loop().time()
    data = b""
    async with asyncio.timeout(20):
        while not (b"\r\n\r\n" in data and data.rstrip().endswith(b"}")):
            try:
                writer.write(b"x-slow: 1\r\n")  # one header line every half second, never the blank line
                await writer.drain()
            except ConnectionError:
                pass
            try:
                async with asyncio.timeout(0.5):
                    chunk = await reader.read(65536)
                if not chunk:
                    break
                data += chunk
            except TimeoutError:
                continue
    writer.close()
    waited = asyncio.get_running_loop().time() - started
    assert data.startswith(b"HTTP/1.1 408"), data[:200]
    assert 9 <= waited <= 15, waited
    err = json.loads(data.partition(b"\r\n\r\n")[2])["error"]
    assert err["message"] and err["type"] == "invalid_request_error", err
    async with aiohttp.ClientSession() as http:
        seen = await (await http.get(f"http://{upstream[0]}:{upstream[1]}/test/seen")).json()
    assert [r for r in seen if r["path"] != "/health"] == [], seen  # Envoy's own health checks aside
