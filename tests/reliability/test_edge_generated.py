"""A generated differential test of the edge, through real Envoy: a few hundred seeded requests, raw bytes over
HTTP/1.1 and (nghttp) HTTP/2, mixing methods, respelled paths, forged and duplicated headers, framings and mutated
bodies, each checked against what the ext_proc decided and what a replica (one recording upstream per pool) saw:

1. whatever reaches a replica was admitted (the ext_proc's ticket and pool header), on the pool of the model the
   ext_proc read, once, on a compute path the replica routes as it is, with a body that reads the same to vLLM's
   parser (Python's json on the bytes) as to the ext_proc's, and never content-encoded (vLLM does not decompress);
2. everything else is a refusal with a 4xx/5xx status and an OpenAI-style JSON error body, never an empty reply
   or a hang;
3. afterwards nothing is held in the ext_proc, it counted no stream error and no unadmitted request.

The hand-written cases are test_edge_envoy.py's and test_http1_envoy.py's; this is the same edge, sampled.
`EXTPROC_EDGE_SEED=7 pytest tests/reliability/test_edge_generated.py` samples another few hundred."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import random
import re
import shutil
import zlib
from dataclasses import dataclass, field

import aiohttp
import pytest

from extproc.server.openai import ENDPOINTS, BadRequest, load_json_object
from tests.conftest import STACK, policy_file, run_upstream
from tests.integration.helpers import healthz, metrics, sample, upstream_reset, wait_idle
from tests.reliability.test_edge_envoy import ALL_ENDPOINTS, spellings
from tests.reliability.test_http2_envoy import (ACK, CONTINUATION, DATA, END_HEADERS, END_STREAM, GOAWAY, HEADERS,
                                                PREFACE, RECV_HEADER, RST_STREAM, SETTINGS, frame)

HI = [{"role": "user", "content": "hi"}]  # a chat request is a list of messages: one will do

SEED = int(os.environ.get("EXTPROC_EDGE_SEED", "46"))  # another seed samples other requests: same invariants
HTTP1_CASES = 320
HTTP2_CASES = 40
MODELS = {name: m["cluster"] for name, m in STACK["models"].items()}  # llama-70b, llama-8b -> their pools
KEY = "sk-acme-1"


@dataclass
class Case:
    """One generated request: what to send, and how it was made (printed when an invariant fails)."""
    n: int
    method: bytes
    path: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    framing: str = "length"   # length | chunked | chunked+length | none | length twice | length differs
    version: bytes = b"HTTP/1.1"
    notes: list[str] = field(default_factory=list)
    host: list[bytes] = field(default_factory=lambda: [b"test"])
    then: Case | None = None  # a second request pipelined behind this one, on the same connection
    smuggled: int | None = None  # the gen-id of a request written inside this one's body: it must never run
    abort: float | None = None  # the client sends this share of the request's bytes, then closes the connection

    def raw(self, close: bool = True) -> bytes:
        head = [self.method + b" " + self.path + b" " + self.version, *(b"host: " + h for h in self.host),
                b"x-gen-id: %d" % self.n] + [k + b": " + v for k, v in self.headers]
        if close:
            head.append(b"connection: close")
        body = self.body
        if self.framing in ("length", "chunked+length", "length twice"):
            head.append(b"content-length: %d" % len(body))
        if self.framing == "length twice":
            head.append(b"content-length: %d" % len(body))
        if self.framing == "length differs":
            head += [b"content-length: %d" % len(body), b"content-length: %d" % (len(body) + 1)]
        if self.framing.startswith("chunked"):
            head.append(b"transfer-encoding: chunked")
            size = max(1, len(body) // 3)
            body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (body[i:i + size] for i in
                                                                  range(0, len(body), size))) + b"0\r\n\r\n"
        data = b"\r\n".join(head) + b"\r\n\r\n" + body
        return data + self.then.raw() if self.then else data


# --- generation -----------------------------------------------------------------------------------------------

OTHER_PATHS = ["/v1/models", "/health", "/v1/messages", "/v1/chat/completions/batch", "/metrics", "/",
               "/v1/models/llama-70b", "/generative_scoring", "/v1/realtime", "/v1/responses/resp_1"]
METHODS = [b"POST"] * 30 + [b"GET", b"PUT", b"HEAD", b"OPTIONS", b"DELETE", b"PATCH", b"post", b"FOO", b"PoSt"]


def gen_path(rng: random.Random) -> tuple[str, str]:
    """(the endpoint it stands for, or "" for none of ours; the path as sent)."""
    endpoint = rng.choice(list(ENDPOINTS)) if rng.random() < 0.85 else rng.choice(OTHER_PATHS)
    how = rng.random()
    if how < 0.5:
        path = endpoint
    elif how < 0.8 and endpoint != "/":
        path = rng.choice(spellings(endpoint))
    else:
        path = rng.choice([
            endpoint + "?model=llama-8b", endpoint + "#frag", endpoint + "?a=1#b", endpoint + "%3Fx",
            endpoint + "%23", endpoint + "/.", endpoint + "/..", endpoint + "%2e", endpoint + "%00",
            endpoint + "%20", endpoint + "%09", "http://test" + endpoint, "http://other.example" + endpoint,
            "/" + "a/" * 3000 + ".." + "/.." * 3000 + endpoint,          # overlong, resolving to the endpoint
            endpoint + "/" + "x" * 9000,                                # overlong
            endpoint.replace("/", "/%2E/"), endpoint.replace("o", "%6F"), endpoint.replace("o", "%6f"),
            endpoint.replace("/", "\\"), endpoint + "\\", "//" + endpoint.lstrip("/"), endpoint + ";model=x",
            endpoint.replace("/", "/;/"), endpoint + "%", endpoint + "%zz", endpoint + "%C0%AE",
            "/v1%2Fchat%2Fcompletions", "*"])
    return (endpoint if endpoint in ENDPOINTS else ""), path


def gen_doc(rng: random.Random, endpoint: str) -> dict:
    model = rng.choice(["llama-70b", "llama-8b"] * 4 + ["gpt-99", "LLAMA-8B", " llama-8b", None])
    kind = ENDPOINTS[endpoint].kind if endpoint else rng.choice(["chat", "input"])
    if kind == "invocations":
        kind = rng.choice(["chat", "completions", "input"])
    if kind == "chat":
        doc = {"messages": [{"role": "user", "content": "hello"}]}
        doc[rng.choice(["max_tokens", "max_completion_tokens"])] = rng.choice([1, 4, 16, "4", 2.0])
    elif kind == "completions":
        doc = {"prompt": rng.choice(["hello", ["a", "b"]]), "max_tokens": rng.choice([1, 4, None])}
    elif kind == "responses":
        doc = {"input": "hello", "max_output_tokens": rng.choice([1, 4, 16])}
    else:
        doc = {"input": "hello", "query": "q", "documents": ["d"], "text_1": "a", "text_2": "b"}
    if rng.random() < 0.2:
        doc["stream"] = rng.choice([True, False, "yes"])
    if rng.random() < 0.15:
        doc["n"] = rng.choice([1, 2])
    if rng.random() < 0.15:
        doc["priority"] = rng.choice([-100, 0, "interactive"])
    if model is not None:
        doc = {"model": model, **doc}
    return doc


def gen_body(rng: random.Random, doc: dict, c: Case) -> bytes:
    text = json.dumps(doc)
    body = text.encode()
    m = rng.random()  # half the bodies as they are, the other half each mangled one way
    mutation = None
    if m < 0.45:
        pass
    elif m < 0.5:  # a duplicate key: both parsers take the last one
        other = rng.choice(list(MODELS) + ["gpt-99"])
        body = (('{"model": "%s", ' % other + text[1:]) if rng.random() < 0.5 else
                (text[:-1] + ', "model": "%s"}' % other)).encode()
        mutation = "duplicate model key"
    elif m < 0.53:
        body = text.replace('"model"', '"mod\\u0065l"', 1).encode()
        mutation = "escaped key"
    elif m < 0.57:
        body, mutation = b"\xef\xbb\xbf" + body, "UTF-8 BOM"
    elif m < 0.6:
        body, mutation = text.encode(rng.choice(["utf-16", "utf-32"])), "UTF-16/32"
    elif m < 0.63:
        body, mutation = text.replace("hello", "h\udcff").encode("utf-8", "surrogateescape"), "non-UTF-8 byte"
    elif m < 0.68:
        body = body + rng.choice([b" x", b"{}", b"\n", b"\x00", b" ", b",", b"]"])
        mutation = "trailing bytes"
    elif m < 0.71:
        body, mutation = b" \t\r\n" + body, "leading whitespace"
    elif m < 0.79:
        encoding = rng.choice([b"gzip", b"deflate", b"GZIP", b" gzip", b"x-gzip", b"identity, gzip", b"br"])
        if rng.random() < 0.85:  # else a client that says so of a plain body (vLLM would read it as it is)
            body = zlib.compress(body) if encoding == b"deflate" else gzip.compress(body)
        if rng.random() < 0.8:
            c.headers.append((b"content-encoding", encoding))
            if rng.random() < 0.3:
                c.headers.append((b"content-encoding", b"identity"))
        mutation = f"compressed body ({encoding.decode()})"
    elif m < 0.83:
        boundary = b"XyZ"
        body = (b"--XyZ\r\ncontent-disposition: form-data; name=\"model\"\r\n\r\nllama-8b\r\n--XyZ\r\n"
                b"content-disposition: form-data; name=\"file\"; filename=\"a.json\"\r\n"
                b"content-type: application/json\r\n\r\n" + body + b"\r\n--XyZ--\r\n")
        c.headers = [(k, v) for k, v in c.headers if k != b"content-type"]
        c.headers.append((b"content-type", b"multipart/form-data; boundary=" + boundary))
        mutation = "multipart"
    elif m < 0.86:
        body, mutation = b"", "empty"
    elif m < 0.89:
        body, mutation = body[:len(body) // 2], "truncated"
    elif m < 0.92:
        body, mutation = (b'{"model": "llama-8b", "model": {}, "messages": [{"role": "user"}]}',
                          "model an object after a string")
    elif m < 0.95:
        body, mutation = text.replace('"llama', '"\\u006clama', 1).encode(), "escaped value"
    else:
        body, mutation = b'{"model": "llama-8b", "max_tokens": 1' + b"0" * 30 + b"}", "huge max_tokens"
    if mutation:
        c.notes.append(mutation)
    return body


def gen_headers(rng: random.Random) -> tuple[list[tuple[bytes, bytes]], list[str]]:
    hs: list[tuple[bytes, bytes]] = []
    notes = []
    ct = rng.random()
    if ct < 0.6:
        hs.append((b"content-type", b"application/json"))
    elif ct < 0.7:
        hs.append((rng.choice([b"Content-Type", b"CONTENT-TYPE"]), rng.choice([b"APPLICATION/JSON",
                                                                               b"application/json; charset=utf-8"])))
    elif ct < 0.8:
        hs += [(b"content-type", b"text/plain"), (b"content-type", b"application/json")]
        notes.append("two content-types")
    elif ct < 0.9:
        hs.append((b"content-type", rng.choice([b"text/plain", b"application/x-www-form-urlencoded"])))
    for p, h in [(0.15, (b"authorization", b"Bearer " + KEY.encode())),
                 (0.05, (b"authorization", b"Bearer sk-nobody")),
                 (0.05, (b"Authorization", b"Bearer " + KEY.encode())),
                 (0.05, (b"api-key", KEY.encode())),
                 (0.1, (b"x-priority", rng.choice([b"interactive", b"batch", b"internal", b"gold", b"\xff"]))),
                 (0.08, (b"x-extproc-cluster", rng.choice([b"vllm_llama8b", b"vllm_llama70b", b"nowhere"]))),
                 (0.05, (b"X-ExtProc-Ticket", b"0-forged")),
                 (0.05, (b"x-extproc-decision", b"accept")),
                 (0.04, (b"x-extproc-replica", b"127.0.0.1:1")),
                 (0.05, (b"x-envoy-retry-on", b"5xx,reset,retriable-status-codes")),
                 (0.05, (b"x-envoy-max-retries", b"3")),
                 (0.03, (b"x-envoy-upstream-rq-timeout-ms", b"1")),
                 (0.03, (b"x-envoy-original-path", b"/v1/models")),
                 (0.04, (b"x-forwarded-for", b"10.0.0.1")),
                 (0.04, (b"x-http-method-override", b"GET")),
                 (0.04, (b"x-vllm-priority", b"-100")),
                 (0.03, (b"x-data-parallel-rank", b"0")),
                 (0.04, (b"expect", b"100-continue")),
                 (0.02, (b"x-big", b"b" * rng.choice([8000, 70000]))),
                 (0.02, (b"upgrade", b"websocket")),
                 (0.02, (b"x-request-id", b"r" * 300))]:
        if rng.random() < p:
            hs.append(h)
            notes.append(h[0].decode() + ("" if len(h[1]) < 40 else f" ({len(h[1])} bytes)"))
    if rng.random() < 0.02:
        hs += [(b"x-h%d" % i, b"1") for i in range(120)]
        notes.append("120 headers")
    if any(k == b"upgrade" for k, _ in hs):
        hs.append((b"connection", b"upgrade"))
    return hs, notes


def generate(rng: random.Random, n: int) -> Case:
    method = rng.choice(METHODS)
    endpoint, path = gen_path(rng)
    headers, notes = gen_headers(rng)
    c = Case(n, method, path.encode("latin-1"), headers, b"", notes=notes)
    c.body = gen_body(rng, gen_doc(rng, endpoint), c)
    f = rng.random()
    c.framing = ("length" if f < 0.75 else "chunked" if f < 0.87 else "none" if f < 0.9 else
                 "chunked+length" if f < 0.94 else "length twice" if f < 0.97 else "length differs")
    if c.framing == "none" and c.body:
        c.framing = "length"
    if rng.random() < 0.03:
        c.version = rng.choice([b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.2"])
    if rng.random() < 0.03:
        c.host = rng.choice([[], [b"test", b"other"], [b"test:1"], [b"te st"]])
        c.notes.append(f"host {c.host}")
    return c


def generate_with_shapes(rng: random.Random, n: int) -> Case:
    """A case, sometimes with a second request pipelined behind it, written inside its body, or abandoned."""
    c = generate(rng, n)
    shape = rng.random()
    if shape < 0.08:
        c.then = generate(rng, n + 100_000)
        c.notes.append("pipelined")
    elif shape < 0.12:  # the body is a whole request, its length declared: it must be read as a body, not run
        inner = valid(rng, n + 200_000)
        c.body, c.smuggled = inner.raw(close=False), inner.n
        c.framing = rng.choice(["length", "chunked"])
        c.notes.append("a request as the body")
    elif shape < 0.16:
        c.abort = rng.choice([1.0, 0.9, 0.5])
        c.notes.append(f"client leaves after {c.abort:.0%} of the bytes")
    return c


def valid(rng: random.Random, n: int) -> Case:
    """A request that is admitted as it is."""
    doc = {"model": rng.choice(list(MODELS)), "messages": HI, "max_tokens": 2}
    return Case(n, b"POST", b"/v1/chat/completions", [(b"content-type", b"application/json")], json.dumps(doc).encode())


# --- sending ----------------------------------------------------------------------------------------------------

@dataclass
class Reply:
    status: int | None            # None: no answer (the connection closed or reset first)
    headers: dict[str, str]
    body: bytes
    reset: bool = False


def parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.split(b"\r\n")
    hs = {}
    for line in lines[1:]:
        k, _, v = line.partition(b":")
        hs[k.strip().lower().decode("latin-1")] = v.strip().decode("latin-1")
    return int(lines[0].split()[1]), hs


async def send_http1(port: int, c: Case, timeout: float = 8.0) -> list[Reply]:
    """Send the case's bytes and read its final responses (1xx skipped; two when one is pipelined behind it) within
    `timeout`: TimeoutError is a hang. Fewer when Envoy closes the connection first: the first one then says
    `reset`."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        data = c.raw()
        writer.write(data if c.abort is None else data[:int(len(data) * c.abort)])
        try:
            await writer.drain()
        except ConnectionError:
            pass
        if c.abort is not None:
            return []
        replies = []
        async with asyncio.timeout(timeout):
            for method in [c.method] + ([c.then.method] if c.then else []):
                try:
                    replies.append(await read_response(reader, method))
                except (asyncio.IncompleteReadError, ConnectionError):
                    break
        return replies or [Reply(None, {}, b"", reset=True)]
    finally:
        writer.close()


async def read_response(reader: asyncio.StreamReader, method: bytes) -> Reply:
    while True:
        status, hs = parse_head((await reader.readuntil(b"\r\n\r\n"))[:-4])
        if status >= 200:
            break
    if method == b"HEAD" or status in (204, 304):
        body = b""
    elif "content-length" in hs:
        body = await reader.readexactly(int(hs["content-length"]))
    elif "chunked" in hs.get("transfer-encoding", ""):
        body = b""
        while (size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)):
            body += (await reader.readexactly(size + 2))[:-2]
        await reader.readuntil(b"\r\n")
    else:
        body = await reader.read()
    return Reply(status, hs, body)


NGHTTP_LINE = re.compile(r"\[\s*\d+\.\d+\] ")
H2_CASES_HEADERS = {b"content-type", b"authorization", b"api-key", b"x-priority", b"x-extproc-cluster",
                    b"x-extproc-ticket", b"x-envoy-retry-on", b"x-envoy-max-retries", b"x-forwarded-for",
                    b"content-encoding", b"x-vllm-priority", b"x-big"}


async def send_http2(port: int, c: Case, tmp_path) -> Reply:
    """The case over HTTP/2 (nghttp, prior knowledge): its method, path, the headers HTTP/2 allows, its body."""
    data = tmp_path / f"body{c.n}"
    data.write_bytes(c.body)
    args = ["nghttp", "-v", "-t", "8", "-H", f":method: {c.method.decode()}", "-H", f":path: {c.path.decode()}",
            "-H", f"x-gen-id: {c.n}"]
    for k, v in c.headers:
        if k.lower() in H2_CASES_HEADERS:
            args += ["-H", f"{k.lower().decode()}: {v.decode('latin-1')}"]
    if c.body:
        args += ["-d", str(data)]
    proc = await asyncio.create_subprocess_exec(*args, f"http://127.0.0.1:{port}/", stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 15)
    text = out.decode("latin-1")
    hs: dict[str, str] = {}
    body = b""
    for line in text.splitlines():
        if m := RECV_HEADER.search(line):
            hs[m.group(1)] = m.group(2)
        elif line.startswith("{") or line.startswith("data:"):  # the body, nghttp's next line after it
            body += NGHTTP_LINE.split(line, 1)[0].encode("latin-1")
    status = int(hs[":status"]) if ":status" in hs else None
    return Reply(status, hs, body, reset=status is None)


# --- checking ---------------------------------------------------------------------------------------------------

def vllm_reads(body: bytes):
    """The body as vLLM's server parses it (starlette: json.loads of the bytes), or None where it cannot."""
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None


def same_json(a, b) -> bool:
    """Equal documents, numbers compared as the doubles both parsers make of them past 64 bits (orjson reads a
    larger integer as a float; no field admission reads goes anywhere near that)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return type(a) is type(b) and a == b or abs(a) >= 2**64 and float(a) == float(b)
    return type(a) is type(b) and a == b


def check_arrival(rec: dict, pool: str, problems: list, where: str) -> None:
    """One request a replica of `pool` received; `where` says which case sent it."""
    values = {}
    for k, v in rec["values"]:
        values.setdefault(k, []).append(v)
    if not rec["ticket"]:
        problems.append(f"{where}: reached {pool} without a ticket: {rec['raw_path'][:120]}")
        return
    if values.get("x-extproc-cluster") != [pool]:
        problems.append(f"{where}: pool header {values.get('x-extproc-cluster')} but reached {pool}")
    raw_path = rec["raw_path"].split("?", 1)[0]
    if raw_path not in ENDPOINTS or rec["path"] != raw_path or rec["method"] != "POST":
        problems.append(f"{where}: reached {pool} as {rec['method']} {rec['raw_path'][:120]!r} "
                        f"(decoded {rec['path'][:120]!r})")
    if any(v.strip().lower() not in ("", "identity") for v in values.get("content-encoding", [])):
        problems.append(f"{where}: an encoded body reached {pool}: {values['content-encoding']}")
    body = rec["body"].encode("latin-1")
    if len(body) < rec["body_len"]:
        return  # the recorder kept its first 16 KiB only (no generated body is that long)
    vllm = vllm_reads(body)
    try:
        ours = load_json_object(body)
    except BadRequest as e:
        problems.append(f"{where}: the ext_proc cannot read the body {pool} got ({e.message}): {body[:200]!r}")
        return
    if not same_json(vllm, ours):
        problems.append(f"{where}: vLLM reads {str(vllm)[:200]}, the ext_proc {str(ours)[:200]}")
    model = ours.get("model")
    if MODELS.get(model) != pool:
        problems.append(f"{where}: model {model!r} ran on {pool}")


def check_refusal(c: Case, r: Reply, problems: list, table: dict, http2: bool = False) -> None:
    where = f"case {c.n} {'h2 ' if http2 else ''}{c.notes} {c.framing} {c.version!r} {c.method!r} {c.path[:120]!r}"
    if r.status is None:
        if http2 and (sum(len(k) + len(v) for k, v in c.headers) > 60 << 10 or not c.path.startswith(b"/")):
            # Past the header list size Envoy announces (60 KiB), or a `:path` HTTP/2 calls malformed (RFC 9113
            # 8.3.1: "/" first, or "*" for OPTIONS): Envoy resets the stream (PROTOCOL_ERROR), as HTTP/2 says.
            return
        problems.append(f"{where}: no answer (reset or closed)")
        return
    if r.status == 200 and c.method == b"GET":
        return  # the model list (or a model's card), which the ext_proc answers itself, or the replica's /health
    if not 400 <= r.status <= 599:
        problems.append(f"{where}: refused with {r.status}? {r.body[:200]!r}")
        return
    key = (r.status, "")
    if c.method != b"HEAD":
        try:
            err = json.loads(r.body)["error"]
            assert isinstance(err["message"], str) and err["message"] and "type" in err and "param" in err
            key = (r.status, err["code"])
        except (ValueError, KeyError, TypeError, AssertionError):
            problems.append(f"{where}: {r.status} without an OpenAI error body: {r.body[:200]!r}")
            return
    if "json" not in r.headers.get("content-type", "") and (c.method != b"HEAD" or r.headers.get("content-type")):
        problems.append(f"{where}: {r.status} content-type {r.headers.get('content-type')!r}")
    if r.status >= 500 and r.status not in (503, 501):
        problems.append(f"{where}: refused with a server error {r.status} {r.body[:200]!r}")
    table[key] = table.get(key, 0) + 1


async def nothing_held(http, metrics_url: str) -> None:
    """Invariant 3: nothing in flight or queued, no stream error, nothing counted as reaching a replica unadmitted."""
    snap = await wait_idle(http, metrics_url, timeout=5)
    assert all(cl["inflight"] == 0 and cl["queue"] == 0 for cl in snap.values()), snap
    assert (await healthz(http, metrics_url))["stream_errors"] == 0
    await asyncio.sleep(1.2)  # the unadmitted report is Envoy's access log, flushed every second
    ms = await metrics(http, metrics_url)
    assert sample(ms, "extproc_stream_errors_total") == 0
    assert sample(ms, "extproc_unadmitted_requests_total") == 0


async def seen(http, upstream) -> list[dict]:
    async with http.get(f"http://{upstream[0]}:{upstream[1]}/test/seen") as r:
        return [x for x in await r.json() if x["path"] != "/health"]  # Envoy's health checks


@pytest.fixture
def small_upstream():
    """A second recording upstream, for the llama-8b pool, so each pool's arrivals are told apart."""
    with run_upstream() as address:
        yield address


async def test_generated_requests_reach_a_replica_only_admitted_on_their_pool(make_stack, tmp_path, upstream,
                                                                            small_upstream):
    policy = policy_file(tmp_path, endpoints=ALL_ENDPOINTS, classes={
        name: {"max_concurrency": 8, "max_queue": 8, "max_wait_ms": 1000} for name in STACK["classes"]})
    s = make_stack(policy, pools={"vllm_llama70b": [upstream], "vllm_llama8b": [small_upstream]})
    pools = {"vllm_llama70b": upstream, "vllm_llama8b": small_upstream}
    rng = random.Random(SEED)
    cases = [generate_with_shapes(rng, n) for n in range(HTTP1_CASES)]
    h2 = shutil.which("nghttp") is not None
    h2_cases = [generate(rng, n) for n in range(HTTP1_CASES, HTTP1_CASES + HTTP2_CASES)] if h2 else []
    for c in h2_cases:  # what nghttp can send: an origin-form path, an upper-case method
        c.path = c.path if len(c.path) < 2000 and not c.path.startswith(b"http") else b"/v1/completions"
        c.method = c.method if c.method.isupper() else b"POST"
    problems: list[str] = []
    table: dict = {}
    sent: dict[int, tuple[Case, Reply | None, bool]] = {}  # gen-id: (case, its answer or None, over HTTP/2)
    async with aiohttp.ClientSession() as http:
        for address in pools.values():
            await upstream_reset(http, address)
        four = asyncio.Semaphore(4)  # a few at once, so the ext_proc's streams interleave

        async def one(c: Case) -> None:
            async with four:
                try:
                    replies = await send_http1(s.listen_port, c)
                except TimeoutError:
                    problems.append(f"case {c.n} {c.notes} {c.method!r} {c.path[:120]!r}: no answer in 8 s (a hang)")
                    replies = []
            first = replies[0] if replies else Reply(None, {}, b"", reset=True)
            sent[c.n] = (c, None if c.abort is not None else first, False)
            if c.then:  # Envoy may close the connection after the first answer (after a 400, say): not read then
                sent[c.then.n] = (c.then, replies[1] if len(replies) > 1 else None, False)

        await asyncio.gather(*(one(c) for c in cases))
        for c in h2_cases:
            sent[c.n] = (c, await send_http2(s.listen_port, c, tmp_path), True)
        smuggled = {c.smuggled: c for c in cases if c.smuggled is not None}
        arrivals: dict[int | None, list] = {}
        for pool, address in pools.items():
            for rec in await seen(http, address):
                ids = [v for k, v in rec["values"] if k == "x-gen-id"]
                n = int(ids[0]) if len(ids) == 1 else None
                arrivals.setdefault(n, []).append(rec)
                if n in smuggled:
                    c = smuggled[n]
                    problems.append(f"case {c.n} {c.notes} {c.framing}: the request in its body ran on {pool}")
                c = sent[n][0] if n in sent else None
                check_arrival(rec, pool, problems, f"case {c.n} {c.notes} {c.method!r} {c.path[:120]!r}" if c else
                              "an arrival no case sent")
        admitted = 0
        for n, (c, r, is_h2) in sent.items():
            got = arrivals.get(n, [])
            if len(got) > 1:
                problems.append(f"case {n} {c.notes}: reached a replica {len(got)} times")
            if got:
                admitted += 1
                if r is not None and (r.status is None or "x-extproc-class" not in r.headers):
                    problems.append(f"case {n} {c.notes}: served, its answer {r.status} {r.headers}")
            elif r is not None:
                check_refusal(c, r, problems, table, is_h2)

        await nothing_held(http, s.metrics_url)
    print(f"\nEDGE generated: {len(sent)} requests, {admitted} reached a replica; refusals:\n" +
          "\n".join(f"  {st} {code}: {k}" for (st, code), k in sorted(table.items())))
    assert problems == [], "\n".join(problems[:40])
    assert admitted >= 30, admitted  # the generator does reach the replicas


# --- HTTP/2 frames nghttp will not send: many streams on one connection, abandoned, cut short, lying ---------------

H2_CONNECTIONS = 6
H2_STREAMS = 24  # per connection


def hpack_int(value: int, prefix_bits: int = 7, first: int = 0) -> bytes:
    """An HPACK integer (RFC 7541 5.1) with its prefix's other bits `first`."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out, value = bytearray([first | limit]), value - limit
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    return bytes(out + bytes([value]))


def hpack(headers: list[tuple[bytes, bytes]]) -> bytes:
    """Literal fields, never indexed, no Huffman: whatever names and values the case has."""
    return b"".join(b"\x00" + hpack_int(len(k)) + k + hpack_int(len(v)) + v for k, v in headers)


def h2_stream(rng: random.Random, stream: int, n: int, t: float) -> tuple[list[tuple[float, bytes]], str]:
    """The frames of one stream, each as (when, bytes) from `t` on (its HEADERS at `t`), and the stream's shape."""
    model = rng.choice(list(MODELS) + ["gpt-99"])
    body = json.dumps({"model": model, "messages": HI, "max_tokens": 2}).encode()
    head = [(b":method", b"POST"), (b":scheme", b"http"),
            (b":path", rng.choice([b"/v1/chat/completions", b"/v1//chat/completions", b"/v1/chat/%63ompletions",
                                   b"/v1/chat%2Fcompletions", b"/invocations"])),
            (b":authority", b"test"), (b"content-type", b"application/json"), (b"x-gen-id", b"%d" % n)]
    for h in [(b"x-extproc-cluster", b"vllm_llama8b"), (b"x-envoy-retry-on", b"5xx"), (b"x-priority", b"batch"),
              (b"content-encoding", b"identity")]:
        if rng.random() < 0.1:
            head.append(h)
    shape = rng.choice(["whole", "whole", "whole", "split headers", "leaves after headers", "leaves mid-body",
                        "trailers only", "trailers after body", "length lies", "headers only", "slow body",
                        "malformed"])
    if shape == "malformed":  # HTTP/2 resets this stream alone: the others on its connection go on
        bad = rng.choice([(b":path", b"v1/chat/completions"), (b":path", b"%5Cv1/chat/completions"), (b":path", b""),
                          (b"X-Upper", b"1"), (b"connection", b"close"), (b"te", b"gzip"), (b":method", b"PUT")])
        head = [h for h in head if h[0] != bad[0]] + [bad] if bad[0] == b":path" else head + [bad]
    if shape == "length lies":
        head.append((b"content-length", b"%d" % (len(body) + rng.choice([-5, 5]))))
    block = hpack(head)
    if shape == "split headers":  # one entry: nothing may come between HEADERS and its CONTINUATION
        cut = len(block) // 2
        frames = [(t, frame(HEADERS, 0, stream, block[:cut]) + frame(CONTINUATION, END_HEADERS, stream, block[cut:]))]
    else:
        frames = [(t, frame(HEADERS, END_HEADERS | (END_STREAM if shape == "headers only" else 0), stream, block))]
    cancel = frame(RST_STREAM, 0, stream, (8).to_bytes(4, "big"))  # CANCEL
    frames += {
        "leaves after headers": [(t + 0.3, cancel)],
        "leaves mid-body": [(t + 0.1, frame(DATA, 0, stream, body[:10])), (t + 0.3, cancel)],
        "trailers only": [(t + 0.1, frame(HEADERS, END_HEADERS | END_STREAM, stream, hpack([(b"x-t", b"1")])))],
        "trailers after body": [(t + 0.1, frame(DATA, 0, stream, body)),
                                (t + 0.2, frame(HEADERS, END_HEADERS | END_STREAM, stream,
                                                hpack([(b"x-extproc-cluster", b"vllm_llama8b")])))],
        "slow body": [(t + 0.1, frame(DATA, 0, stream, body[:7])), (t + 0.5, frame(DATA, END_STREAM, stream,
                                                                                  body[7:]))],
        "headers only": [],
    }.get(shape, [(t + 0.1, frame(DATA, END_STREAM, stream, body))])
    return frames, shape


async def h2_connection(port: int, frames: list[tuple[float, bytes]], streams: set[int],
                        timeout: float = 10.0) -> set[int]:
    """Send `frames` at their times on one connection while reading Envoy's; return those of `streams` that never
    ended (no END_STREAM, RST_STREAM or GOAWAY covering them within `timeout`, or the connection closed first)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    open_ = set(streams)

    async def read() -> None:
        while open_:
            head = await reader.readexactly(9)
            kind, flags, stream = head[3], head[4], int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
            payload = await reader.readexactly(int.from_bytes(head[:3], "big"))
            if kind == RST_STREAM or (kind in (HEADERS, DATA) and flags & END_STREAM):
                open_.discard(stream)
            elif kind == GOAWAY:
                last = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
                open_.difference_update({st for st in open_ if st > last})
            elif kind == DATA and payload:  # give the window back, so answers keep coming
                writer.write(frame(0x8, 0, 0, len(payload).to_bytes(4, "big")))

    reading = asyncio.ensure_future(read())
    try:
        writer.write(PREFACE + frame(SETTINGS, 0, 0) + frame(SETTINGS, ACK, 0))
        started = asyncio.get_running_loop().time()
        for when, data in sorted(frames, key=lambda f: f[0]):
            await asyncio.sleep(max(0.0, started + when - asyncio.get_running_loop().time()))
            writer.write(data)
            await writer.drain()
        async with asyncio.timeout(timeout):
            await reading
    except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
        pass  # what is still open is reported
    finally:
        reading.cancel()
        writer.close()
    return open_


async def test_generated_http2_streams_on_shared_connections_leave_nothing_held(make_stack, tmp_path, upstream,
                                                                              small_upstream):
    """Streams of every shape multiplexed on a few connections (whole, headers split by CONTINUATION, abandoned
    after their headers or mid-body, trailers only or after the body, a content-length that lies, no body, a
    malformed header block): every
    stream ends (an answer or Envoy's reset, within a bound), what reaches a replica was admitted on its model's
    pool, once, and when all are done nothing is held in the ext_proc."""
    policy = policy_file(tmp_path, classes={
        name: {"max_concurrency": 64, "max_queue": 64, "max_wait_ms": 1000} for name in STACK["classes"]})
    s = make_stack(policy, pools={"vllm_llama70b": [upstream], "vllm_llama8b": [small_upstream]})
    pools = {"vllm_llama70b": upstream, "vllm_llama8b": small_upstream}
    rng = random.Random(SEED)
    shapes: dict[int, str] = {}
    connections = []
    for i in range(H2_CONNECTIONS):
        frames, ours = [], set()
        for k in range(H2_STREAMS):
            n = 1000 * i + k
            stream_frames, shapes[n] = h2_stream(rng, 2 * k + 1, n, 0.02 * k)  # streams open in order
            frames += stream_frames
            if "leaves" not in shapes[n]:
                ours.add(2 * k + 1)
        connections.append((frames, ours))
    problems: list[str] = []
    async with aiohttp.ClientSession() as http:
        for address in pools.values():
            await upstream_reset(http, address)
        hung = await asyncio.gather(*(h2_connection(s.listen_port, f, o) for f, o in connections))
        for i, streams in enumerate(hung):
            problems += [f"connection {i} stream {st} ({shapes[1000 * i + (st - 1) // 2]}): never ended"
                         for st in sorted(streams)]
        counts: dict[int, int] = {}
        for pool, address in pools.items():
            for rec in await seen(http, address):
                n = int(dict(rec["values"]).get("x-gen-id", -1))
                counts[n] = counts.get(n, 0) + 1
                check_arrival(rec, pool, problems, f"h2 stream {n} ({shapes.get(n)})")
        problems += [f"h2 stream {n} ({shapes.get(n)}) reached a replica {k} times" for n, k in counts.items() if k > 1]
        await nothing_held(http, s.metrics_url)
    served = sum(counts.values())
    print(f"\nEDGE generated HTTP/2: {len(shapes)} streams on {H2_CONNECTIONS} connections, {served} served")
    assert problems == [], "\n".join(problems[:40])
    assert served >= H2_CONNECTIONS * H2_STREAMS // 4, served
