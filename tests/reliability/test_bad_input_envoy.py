"""Bad input through real Envoy: every malformed request gets a clear 4xx (OpenAI-style JSON when it is ours),
never a 5xx, never a crash, never a slot. Odd-but-legal requests (duplicated headers, non-UTF-8 bytes, unknown
classes) are served with a deterministic class. The table of what each case gets is in docs/reliability.md."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from tests.conftest import policy_file
from tests.integration.helpers import chat, healthz, metrics, raw_request, sample, wait_idle

def openai_error(body: bytes) -> dict:
    err = json.loads(body)["error"]
    assert err["message"] and err["type"] and "code" in err
    return err


async def test_malformed_requests_get_clear_4xx_and_take_no_slot(make_stack, tmp_path):
    s = make_stack(policy_file(tmp_path), extproc_args=["--max-body-bytes", str(128 << 10)])
    msg = [{"role": "user", "content": "hi"}]
    ours = [  # (case, body, status, error code or param)
        ("malformed JSON", b"{not json", 400, "invalid_json"),
        ("truncated JSON", json.dumps(chat())[:30].encode(), 400, "invalid_json"),
        ("not an object", b"[1, 2]", 400, "invalid_json"),
        ("empty body", b"", 400, "invalid_body"),
        ("max_tokens: \"lots\"", json.dumps(chat(max_tokens="lots")).encode(), 400, "max_tokens"),
        ("max_tokens: -5", json.dumps(chat(max_tokens=-5)).encode(), 400, "max_tokens"),
        ("max_tokens: 10**12", json.dumps(chat(max_tokens=10**12)).encode(), 400, "max_tokens"),
        # Past ~1e308 a number is not a double: the parser refuses it before any field is read.
        ("max_tokens: 10**400", json.dumps(chat(max_tokens=10**400)).encode(), 400, "invalid_json"),
        # "yes" is a stream to vLLM (pydantic's lax bool); "maybe" it refuses
        ("stream: \"maybe\"", json.dumps(chat(stream="maybe")).encode(), 400, "stream"),
        ("model missing", json.dumps({"messages": msg}).encode(), 400, "model"),
        ("model: 42", json.dumps({"model": 42, "messages": msg}).encode(), 400, "model"),
        ("priority: [1]", json.dumps(chat(priority=[1])).encode(), 400, "priority"),
        ("unknown model", json.dumps(chat(model="gpt-99")).encode(), 404, "unknown_model"),
        # vLLM answers these 400 before it runs anything (tests/fixtures/vllm/differential.json)
        ("messages: null", json.dumps(chat(messages=None)).encode(), 400, "messages"),
        ("messages: []", json.dumps(chat(messages=[])).encode(), 400, "messages"),
        ("a message without a role", json.dumps(chat(messages=[{"content": "hi"}])).encode(), 400, "messages"),
        ("body over the ext_proc limit (200 KB)",
         json.dumps(chat(messages=[{"role": "user", "content": "x" * 200_000}])).encode(), 413, "body_too_large"),
    ]
    # vLLM refuses a body whose Content-Type is not application/json (any case, parameters allowed) with 400
    media = [("no content-type", None), ("content-type: text/plain", b"text/plain"),
             ("content-type: application/x-www-form-urlencoded (curl -d)", b"application/x-www-form-urlencoded")]
    ours += [(case, json.dumps(chat()).encode(), 400, "unsupported_media_type", ctype) for case, ctype in media]
    table = []
    async with aiohttp.ClientSession() as http:
        for case, body, status, code, *ctype in ours:
            ctype = ctype[0] if ctype else b"application/json"
            got, headers, text = await raw_request(s.listen_port, [] if ctype is None else [(b"content-type", ctype)],
                                                   body)
            assert got == status, (case, got, text[:200])
            err = openai_error(text)
            assert code in (err["code"], err["param"]), (case, err)
            assert headers["x-extproc-decision"] == "invalid", case
            table.append((case, got, err["code"]))

        # Envoy's own limits answer before the ext_proc sees anything; envoy.yaml's local_reply_config gives
        # them the same OpenAI error shape.
        for case, status, headers, body, code in [
                ("body over Envoy's 4 MiB buffer", 413, [(b"content-type", b"application/json")],
                 b'{"model": "llama-70b", "x": "' + b"x" * (5 << 20) + b'"}', "request_payload_too_large"),
                ("100 KB header value", 431, [(b"x-priority", b"i" * 100_000)], b"{}", "http1.headers_too_large")]:
            got, hs, text = await raw_request(s.listen_port, headers, body)
            assert got == status, (case, got)
            assert hs["content-type"] == "application/json", (case, hs)
            err = openai_error(text)
            assert err["type"] == "invalid_request_error" and err["code"] == code and err["message"], (case, err)
            assert "param" in err and err["param"] is None, (case, err)  # the ext_proc's shape, key for key
            table.append((case, got, f"Envoy: {err['code']}"))

        snap = await wait_idle(http, s.metrics_url)  # a slot is released when Envoy's trailers/ALS arrive
        assert all(c["inflight"] == 0 and c["queue"] == 0 for c in snap.values()), snap
        ms = await metrics(http, s.metrics_url)
        assert sample(ms, "extproc_stream_errors_total") == 0
        assert (await healthz(http, s.metrics_url))["stream_errors"] == 0
        assert sample(ms, "extproc_requests_total", decision="invalid") == len(ours)
        assert sample(ms, "extproc_requests_total", decision="accept") == 0
    print("\nRELIABILITY bad input:\n" + "\n".join(f"  {c}: {st} {code}" for c, st, code in table))


async def test_odd_but_legal_headers_are_served_without_privilege_or_crash(make_stack, tmp_path):
    policy = policy_file(tmp_path, tenants=[
        {"name": "acme", "api_keys": ["sk-acme-1"], "max_class": "batch", "default_class": "batch"},
        {"name": "chat", "api_keys": ["sk-chat-1"], "max_class": "interactive"}],
        anonymous={"max_class": "batch", "default_class": "batch"})
    s = make_stack(policy)
    body = json.dumps(chat()).encode()
    ct = (b"content-type", b"application/json")
    cases = [  # (case, headers, classes it may get)
        ("two x-priority (batch, interactive), anonymous", [ct, (b"x-priority", b"batch"),
                                                            (b"x-priority", b"interactive")], {"batch"}),
        # Two different keys are refused (401): test_edge_envoy's key table.
        ("two authorization, the same key", [ct, (b"authorization", b"Bearer sk-chat-1"),
                                             (b"authorization", b"Bearer sk-chat-1"),
                                             (b"x-priority", b"interactive")], {"interactive"}),
        ("non-UTF-8 x-priority", [ct, (b"x-priority", b"\xff\xfeinteractive")], {"batch"}),
        ("non-UTF-8 authorization", [ct, (b"authorization", b"Bearer \xc3\x28\xff"),
                                     (b"x-priority", b"interactive")], {"batch"}),
        ("unknown class x-priority: gold", [ct, (b"x-priority", b"gold")], {"batch"}),
        ("content-type: Application/JSON; charset=utf-8", [(b"content-type", b"Application/JSON; charset=utf-8")],
         {"batch"}),
        ("x-priority: INTERNAL (case, spaces)", [ct, (b"x-priority", b"  INTERNAL ")], {"internal"}),
    ]
    table = []
    async with aiohttp.ClientSession() as http:
        for case, headers, allowed in cases:
            got, hs, text = await raw_request(s.listen_port, headers, body)
            assert got == 200, (case, got, text[:200])
            assert hs["x-extproc-class"] in allowed, (case, hs["x-extproc-class"])
            table.append((case, got, hs.get("x-extproc-class")))
        # The client has its response before Envoy's trailers/ALS report reach us: wait for the release.
        idle = await wait_idle(http, s.metrics_url)
        snap = await healthz(http, s.metrics_url)
        assert all(c["inflight"] == 0 for c in idle.values()) and snap["stream_errors"] == 0, snap
        ms = await metrics(http, s.metrics_url)
        assert sample(ms, "extproc_unknown_class_claims_total") >= 1
        assert sample(ms, "extproc_stream_errors_total") == 0
    print("\nRELIABILITY odd headers:\n" + "\n".join(f"  {c}: {st} class={cls}" for c, st, cls in table))
