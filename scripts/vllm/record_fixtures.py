#!/usr/bin/env python3
"""Record parity fixtures of a real vLLM OpenAI server into tests/fixtures/vllm/ (standard library only).

    python3 -m scripts.vllm.record_fixtures                 # starts vLLM (scripts/vllm/serve.py), records, stops
    python3 -m scripts.vllm.record_fixtures --url http://127.0.0.1:8000   # against a running server
    python3 -m scripts.vllm.record_fixtures --no-perf       # skip the latency / throughput measurements
    python3 -m scripts.vllm.record_fixtures --only-lora      # only lora*.json (one server with --enable-lora)

The file format is described in tests/fixtures/vllm/README.md; the shape rules in scripts/vllm/fixture_format.py.
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import socket
import sys
import threading
import time
import urllib.parse
from pathlib import Path

from scripts.vllm.fixture_format import dumps, normalize, shape
from scripts.vllm.serve import ROOT, VLLMServer

OUT = ROOT / "tests" / "fixtures" / "vllm"
MODEL = "tiny-llama"
EOS_ID = 1  # build_model.py: "</s>"
CHAT_MESSAGES = [{"role": "user", "content": "hello there, how is the queue today?"}]
PROMPT = "The admission server said"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]

# Response headers whose values are recorded verbatim; all others keep only their name.
HEADER_VALUES = {"content-type", "transfer-encoding", "server", "vary", "connection"}


class Client:
    def __init__(self, url: str, timeout: float = 120.0):
        u = urllib.parse.urlsplit(url)
        self.host, self.port, self.timeout = u.hostname, u.port or 80, timeout

    def conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def request(self, method: str, path: str, body=None, raw: bytes | None = None, headers=None):
        """-> (status, [(name, value)], body bytes, seconds)."""
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        hdrs = {"content-type": "application/json"} if data is not None else {}
        hdrs.update(headers or {})
        c = self.conn()
        t0 = time.perf_counter()
        try:
            c.request(method, path, body=data, headers=hdrs)
            r = c.getresponse()
            payload = r.read()
            return r.status, r.getheaders(), payload, time.perf_counter() - t0
        finally:
            c.close()

    def json(self, method: str, path: str, body=None):
        status, headers, payload, self.last_seconds = self.request(method, path, body)
        return status, headers, json.loads(payload) if payload else None

    def stream(self, path: str, body: dict):
        """-> (status, headers, raw decoded body bytes, [(t_since_send, bytes_read)]) for an SSE response."""
        c = self.conn()
        t0 = time.perf_counter()
        try:
            c.request("POST", path, body=json.dumps(body).encode(), headers={"content-type": "application/json"})
            r = c.getresponse()
            chunks, reads = [], []
            while True:
                b = r.read1(65536)
                if not b:
                    break
                chunks.append(b)
                reads.append((time.perf_counter() - t0, len(b)))
            return r.status, r.getheaders(), b"".join(chunks), reads
        finally:
            c.close()


def header_record(headers, keep_length: bool = False) -> dict:
    out = {}
    for name, value in headers:
        n = name.lower()
        if n in HEADER_VALUES or (keep_length and n == "content-length"):
            out[n] = value
        elif n == "content-length":
            out[n] = "<int>"
        elif n == "date":
            out[n] = "<http-date>"
        else:
            out[n] = "<str>"
    return dict(sorted(out.items()))


def json_record(request: dict, status: int, headers, body) -> dict:
    formats: dict = {}
    norm = normalize(body, formats=formats)
    return {"request": request, "status": status, "headers": header_record(headers),
            "shape": shape(body), "formats": dict(sorted(formats.items())), "body": norm}


# ---------------------------------------------------------------------------------------------------- SSE
def parse_sse(raw: bytes) -> tuple[dict, list]:
    text = raw.decode("utf-8")
    framing = {
        "prefix": "data: ",
        "separator": "\n\n",
        "ends_with_done": text.endswith("data: [DONE]\n\n"),
        "all_events_prefixed": True,
        "other_lines": [],
        "crlf_seen": "\r\n" in text,
        "trailing_bytes_after_done": "",
    }
    body, sep, tail = text.rpartition("data: [DONE]\n\n")
    if sep and tail:
        framing["trailing_bytes_after_done"] = tail
    blocks = text.split("\n\n")
    if blocks and blocks[-1] == "":
        blocks.pop()
    else:
        framing["unterminated_tail"] = blocks[-1] if blocks else ""
    events = []
    for block in blocks:
        lines = block.split("\n")
        for extra in lines[1:]:
            framing["other_lines"].append(extra)
        line = lines[0]
        if not line.startswith("data: "):
            framing["all_events_prefixed"] = False
            framing["other_lines"].append(line)
            continue
        data = line[len("data: "):]
        events.append("[DONE]" if data == "[DONE]" else json.loads(data))
    return framing, events


def classify(ev) -> str:
    if ev == "[DONE]":
        return "done"
    choices = ev.get("choices")
    if choices == [] and ev.get("usage"):
        return "usage"
    ch = choices[0] if choices else {}
    delta = ch.get("delta") or {}
    if ch.get("finish_reason") is not None:
        return "finish"
    if "role" in delta:
        return "role"
    return "content"


def usage_state(ev) -> str:
    if ev == "[DONE]":
        return "n/a"
    if "usage" not in ev:
        return "absent"
    return "null" if ev["usage"] is None else "object"


def compress(kinds: list[str]) -> list[str]:
    out: list[str] = []
    for k in kinds:
        if out and out[-1] in (k, k + "*"):
            out[-1] = k + "*"
        else:
            out.append(k)
    return out


def stream_record(client: Client, path: str, body: dict) -> dict:
    status, headers, raw, reads = client.stream(path, body)
    return stream_doc(path, body, status, headers, raw) | {"http_reads": len(reads)}


def stream_doc(path: str, body: dict, status: int, headers, raw: bytes) -> dict:
    """A recorded SSE stream: framing, event kinds, and each event's shape and normalized body. `index`: the
    choice index an event is about (n > 1 and prompt lists interleave their choices' chunks)."""
    framing, events = parse_sse(raw)
    recs = []
    for ev in events:
        kind = classify(ev)
        rec = {"kind": kind, "usage": usage_state(ev)}
        if ev != "[DONE]":
            formats: dict = {}
            rec["shape"] = shape(ev)
            rec["body"] = normalize(ev, formats=formats)
            rec["formats"] = dict(sorted(formats.items()))
            if ev.get("choices"):
                ch = ev["choices"][0]
                delta = ch.get("delta", {})
                rec["index"] = ch.get("index")
                rec["delta_keys"] = sorted(delta) if "delta" in ch else None
                content = delta.get("content") if "delta" in ch else ch.get("text")
                rec["has_text"] = bool(content)
        recs.append(rec)
    kinds = [r["kind"] for r in recs]
    return {
        "request": {"method": "POST", "path": path, "body": body},
        "status": status,
        "headers": header_record(headers),
        "framing": framing,
        "sequence": compress(kinds),
        "counts": {k: kinds.count(k) for k in dict.fromkeys(kinds)},
        "events": recs,
    }


# ---------------------------------------------------------------------------------------------------- metrics
SAMPLE_RE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)')
LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict:
    fams: dict = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, help_ = line[7:].partition(" ")
            fams.setdefault(name, {"type": None, "help": "", "labels": set(), "samples": set()})["help"] = help_
        elif line.startswith("# TYPE "):
            name, _, typ = line[7:].partition(" ")
            fams.setdefault(name, {"type": None, "help": "", "labels": set(), "samples": set()})["type"] = typ
        elif line and not line.startswith("#"):
            m = SAMPLE_RE.match(line)
            if not m:
                continue
            sample = m.group(1)
            fam = next((f for f in (sample, *(sample[: -len(s)] for s in
                        ("_total", "_created", "_bucket", "_count", "_sum") if sample.endswith(s))) if f in fams),
                       sample)
            entry = fams.setdefault(fam, {"type": None, "help": "", "labels": set(), "samples": set()})
            entry["samples"].add(sample)
            for k, _ in LABEL_RE.findall(m.group(3) or ""):
                if k != "le":
                    entry["labels"].add(k)
    return {k: {"type": v["type"], "help": v["help"], "labels": sorted(v["labels"]),
                "samples": sorted(v["samples"])} for k, v in sorted(fams.items())}


def metric_values(text: str, name: str) -> dict:
    out = {}
    for line in text.splitlines():
        m = SAMPLE_RE.match(line)
        if m and m.group(1) == name:
            labels = dict(LABEL_RE.findall(m.group(3) or ""))
            labels.pop("engine", None)
            labels.pop("model_name", None)
            out[",".join(f"{k}={v}" for k, v in sorted(labels.items()))] = float(m.group(4))
    return out


def get_metrics(client: Client) -> str:
    return client.request("GET", "/metrics")[2].decode()


REQUIRED_SAMPLES = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
    "vllm:request_queue_time_seconds_bucket",
]


# ---------------------------------------------------------------------------------------------------- abort
def abort_stream(client: Client, events_before_abort: int = 3) -> dict:
    """Open a long stream, read a few events, close the socket; watch /metrics react."""
    before = get_metrics(client)
    body = {"model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": 1500, "stream": True, "ignore_eos": True}
    sock = socket.create_connection((client.host, client.port), timeout=30)
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
    buf = b""
    while buf.count(b"data: ") < events_before_abort:
        chunk = sock.recv(65536)
        if not chunk:
            break
        buf += chunk
    running_during = metric_values(get_metrics(client), "vllm:num_requests_running")
    t_close = time.perf_counter()
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()
    timeline = []
    seen_abort_after = None
    while time.perf_counter() - t_close < 10:
        text = get_metrics(client)
        t = time.perf_counter() - t_close
        running = sum(metric_values(text, "vllm:num_requests_running").values())
        abort = metric_values(text, "vllm:request_success_total").get("finished_reason=abort", 0.0)
        timeline.append({"t_s": round(t, 3), "running": running, "abort_total": abort})
        if seen_abort_after is None and abort > metric_values(before, "vllm:request_success_total").get(
                "finished_reason=abort", 0.0) and running == 0:
            seen_abort_after = round(t, 3)
            break
        time.sleep(0.05)
    after = get_metrics(client)
    return {
        "request": {"method": "POST", "path": "/v1/chat/completions", "body": body},
        "events_read_before_close": buf.count(b"data: "),
        "running_while_streaming": running_during,
        "request_success_total_before": metric_values(before, "vllm:request_success_total"),
        "request_success_total_after": metric_values(after, "vllm:request_success_total"),
        "num_requests_running_after": metric_values(after, "vllm:num_requests_running"),
        "abort_counted": seen_abort_after is not None,
        "seconds_until_abort_counted_and_running_zero": seen_abort_after,
        "timeline": timeline[:40],
    }


# ---------------------------------------------------------------------------------------------------- perf
def perf(client: Client) -> dict:
    res: dict = {"note": "machine-dependent measurements (2-core CPU VM); not a parity fixture"}
    lat = []
    for _ in range(5):
        s, _, _, dt = client.request("POST", "/v1/chat/completions",
                                     {"model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": 16,
                                      "ignore_eos": True})
        assert s == 200
        lat.append(dt)
    res["single_chat_16_tokens_latency_s"] = {"runs": [round(x, 4) for x in lat],
                                              "median": round(sorted(lat)[len(lat) // 2], 4)}
    ttft = []
    for _ in range(5):
        _, _, _, reads = client.stream("/v1/chat/completions", {"model": MODEL, "messages": CHAT_MESSAGES,
                                                                "max_tokens": 16, "stream": True})
        ttft.append(reads[0][0])
    res["stream_first_bytes_s"] = {"runs": [round(x, 4) for x in ttft],
                                   "median": round(sorted(ttft)[len(ttft) // 2], 4)}
    for conc, max_tokens in ((1, 256), (4, 256), (16, 128), (64, 64)):
        out, errors = [], []

        def one():
            try:
                s, _, body, dt = client.request("POST", "/v1/completions",
                                                {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens,
                                                 "ignore_eos": True})
                out.append((dt, json.loads(body)["usage"]["completion_tokens"]))
            except Exception as e:  # pragma: no cover
                errors.append(repr(e))

        threads = [threading.Thread(target=one) for _ in range(conc)]
        t0 = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.perf_counter() - t0
        toks = sum(n for _, n in out)
        lats = sorted(dt for dt, _ in out)
        res[f"concurrency_{conc}"] = {
            "requests": conc, "max_tokens": max_tokens, "wall_s": round(wall, 3),
            "generated_tokens": toks, "tokens_per_s": round(toks / wall, 1),
            "latency_s_min": round(lats[0], 3) if lats else None,
            "latency_s_max": round(lats[-1], 3) if lats else None, "errors": errors,
        }
    return res


# ---------------------------------------------------------------------------------------------------- LoRA
LORA_DIR = ROOT / ".cache" / "vllm-model"
LORA_RANK = 8  # scripts/vllm/build_lora.py
LORA_SERVER_ARGS = ["--enable-lora", "--max-loras", "1", "--max-lora-rank", str(LORA_RANK)]
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
# At start-up: a1 in the name=path form, a3 in the JSON form naming the second served name as its base model.
LORA_MODULES = [f"a1={LORA_DIR / 'lora-a1'}",
                json.dumps({"name": "a3", "path": str(LORA_DIR / "lora-a2"), "base_model_name": "tiny-llama-small"})]


def any_record(request: dict, status: int, headers, payload: bytes) -> dict:
    """A response that may be JSON or plain text (vLLM's load/unload answer text)."""
    try:
        decoded = json.loads(payload)
    except ValueError:
        return {"request": request, "status": status, "headers": header_record(headers, keep_length=True),
                "shape": None, "text": payload.decode(errors="replace")}
    return json_record(request, status, headers, decoded) | {"headers": header_record(headers, keep_length=True)}


def lora_metrics(text: str) -> dict:
    """The /metrics lines about LoRA and the waiting-by-reason gauge, verbatim but for the engine label."""
    lines = [re.sub(r'engine="[^"]*",?', "", ln) for ln in text.splitlines()
             if "lora" in ln.lower() or "num_requests_waiting_by_reason" in ln]
    return {"lines": lines,
            "num_requests_waiting_by_reason": metric_values(text, "vllm:num_requests_waiting_by_reason")}


def lora_deferred(client: Client, names: tuple[str, str], hold_s: float = 10.0) -> dict:
    """Two long streams for two adapters on a --max-loras 1 server: the second waits for the first's slot.
    What /metrics says while it waits."""
    bodies = [{"model": name, "prompt": PROMPT, "max_tokens": 1800, "stream": True, "ignore_eos": True}
              for name in names]
    socks = []
    for body in bodies:
        payload = json.dumps(body).encode()
        sock = socket.create_connection((client.host, client.port), timeout=30)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
        socks.append(sock)
        time.sleep(0.3)  # the first is running before the second arrives
    try:
        seen = None
        deadline = time.monotonic() + hold_s
        while time.monotonic() < deadline:
            text = get_metrics(client)
            seen = {"num_requests_running": sum(metric_values(text, "vllm:num_requests_running").values()),
                    "num_requests_waiting": sum(metric_values(text, "vllm:num_requests_waiting").values()),
                    **lora_metrics(text)}
            if seen["num_requests_running"] == 1 and seen["num_requests_waiting"] == 1:
                break
            time.sleep(0.1)
    finally:
        for sock in socks:
            sock.close()
    return {"requests": [{"method": "POST", "path": "/v1/completions", "body": body} for body in bodies],
            "while_both_held": seen}


def record_lora(client: Client, out: Path) -> None:
    """Against a server started with LORA_SERVER_ARGS, --lora-modules LORA_MODULES and LORA_ENV: the adapters'
    cards, answers under their names, runtime load/unload, errors, LoRA metrics."""
    a2_path = str(LORA_DIR / "lora-a2")

    def write(name: str, obj) -> None:
        # Absolute paths of this checkout become "<repo>" so the files do not depend on where it lives.
        (out / name).write_text(dumps(obj).replace(str(ROOT), "<repo>"))
        print(f"[record] {name}")

    def call(method: str, path: str, body=None) -> dict:
        s, h, payload, _ = client.request(method, path, body)
        return any_record({"method": method, "path": path, "body": body}, s, h, payload)

    def models() -> dict:
        """One GET /v1/models: its record, and the cards' roots (paths), which the record's shape leaves out."""
        s, h, payload, _ = client.request("GET", "/v1/models")
        rec = any_record({"method": "GET", "path": "/v1/models", "body": None}, s, h, payload)
        rec["roots"] = {c["id"]: c["root"] for c in json.loads(payload)["data"]}
        return rec

    def chat(model: str) -> dict:
        return call("POST", "/v1/chat/completions",
                    {"model": model, "messages": CHAT_MESSAGES, "max_tokens": 4, "temperature": 0})

    load_a2 = {"lora_name": "a2", "lora_path": a2_path}
    rec: dict = {"server_args": LORA_SERVER_ARGS + ["--lora-modules", *LORA_MODULES],
                 "server_env": LORA_ENV}
    rec["models"] = models()
    rec["chat_a1"] = chat("a1")
    rec["chat_a3"] = chat("a3")
    rec["completions_a1"] = call("POST", "/v1/completions", {"model": "a1", "prompt": PROMPT, "max_tokens": 4,
                                                             "temperature": 0})
    rec["chat_unknown_model"] = chat("no-such-lora")
    rec["load_a2"] = call("POST", "/v1/load_lora_adapter", load_a2)
    rec["models_after_load"] = models()
    rec["chat_a2"] = chat("a2")
    rec["load_a2_again"] = call("POST", "/v1/load_lora_adapter", load_a2)
    rec["load_a2_inplace"] = call("POST", "/v1/load_lora_adapter", load_a2 | {"load_inplace": True})
    rec["load_missing_path"] = call("POST", "/v1/load_lora_adapter",
                                    {"lora_name": "ghost", "lora_path": str(LORA_DIR / "no-such-adapter")})
    rec["models_after_failed_load"] = models()
    rec["load_empty_name"] = call("POST", "/v1/load_lora_adapter", {"lora_name": "", "lora_path": a2_path})
    rec["load_no_path"] = call("POST", "/v1/load_lora_adapter", {"lora_name": "a3"})
    deferred = lora_deferred(client, ("a1", "a2"))
    rec["unload_a2"] = call("POST", "/v1/unload_lora_adapter", {"lora_name": "a2"})
    rec["models_after_unload"] = models()
    rec["chat_a2_after_unload"] = chat("a2")
    rec["unload_a2_again"] = call("POST", "/v1/unload_lora_adapter", {"lora_name": "a2"})
    rec["unload_empty_name"] = call("POST", "/v1/unload_lora_adapter", {"lora_name": ""})
    write("lora.json", rec)
    write("lora_metrics.json", {"server_args": rec["server_args"], "deferred": deferred,
                                "after_all": lora_metrics(get_metrics(client))})

# ---------------------------------------------------------------------------------------------------- main
def record(client: Client, out: Path, do_perf: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)

    def write(name: str, obj) -> None:
        (out / name).write_text(obj if isinstance(obj, str) else dumps(obj))
        print(f"[record] {name}")

    # health / version / models
    s, h, payload, _ = client.request("GET", "/health")
    write("health.json", {"request": {"method": "GET", "path": "/health"}, "status": s,
                          "headers": header_record(h, keep_length=True), "body": payload.decode()})
    s, h, body = client.json("GET", "/version")
    write("version.json", json_record({"method": "GET", "path": "/version"}, s, h, body) | {"raw": body})
    s, h, body = client.json("GET", "/v1/models")
    write("models.json", json_record({"method": "GET", "path": "/v1/models"}, s, h, body))

    # non-streaming
    req = {"model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": 8, "temperature": 0}
    write("chat.json", json_record({"method": "POST", "path": "/v1/chat/completions", "body": req},
                                   *client.json("POST", "/v1/chat/completions", req)))
    first_chat_seconds = client.last_seconds
    client.json("POST", "/v1/chat/completions", req)
    second_chat_seconds = client.last_seconds
    req = {"model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": 8, "temperature": 0,
           "logit_bias": {str(EOS_ID): 100}}
    write("chat_stop.json", json_record({"method": "POST", "path": "/v1/chat/completions", "body": req},
                                        *client.json("POST", "/v1/chat/completions", req)))
    req = {"model": "tiny-llama-small", "messages": CHAT_MESSAGES, "max_tokens": 4, "temperature": 0}
    write("chat_small_model.json", json_record({"method": "POST", "path": "/v1/chat/completions", "body": req},
                                               *client.json("POST", "/v1/chat/completions", req)))
    req = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    write("completions.json", json_record({"method": "POST", "path": "/v1/completions", "body": req},
                                          *client.json("POST", "/v1/completions", req)))

    # streaming
    base_chat = {"model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": 6, "temperature": 0, "stream": True}
    base_cmpl = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True}
    usage = {"stream_options": {"include_usage": True}}
    cont = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    write("chat_stream.json", stream_record(client, "/v1/chat/completions", base_chat))
    write("chat_stream_usage.json", stream_record(client, "/v1/chat/completions", base_chat | usage))
    write("chat_stream_continuous_usage.json", stream_record(client, "/v1/chat/completions", base_chat | cont))
    write("chat_stream_stop.json", stream_record(client, "/v1/chat/completions",
                                                 base_chat | usage | {"logit_bias": {str(EOS_ID): 100}}))
    write("completions_stream.json", stream_record(client, "/v1/completions", base_cmpl))
    write("completions_stream_usage.json", stream_record(client, "/v1/completions", base_cmpl | usage))

    # errors
    long_prompt = " ".join(["admission"] * 2100)
    mid_prompt = " ".join(["admission"] * 1500)
    cases = [
        ("unknown_model", "POST", "/v1/chat/completions",
         {"model": "no-such-model", "messages": CHAT_MESSAGES, "max_tokens": 4}, None),
        ("unknown_model_completions", "POST", "/v1/completions",
         {"model": "no-such-model", "prompt": PROMPT, "max_tokens": 4}, None),
        ("max_tokens_beyond_context", "POST", "/v1/chat/completions",
         {"model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": 100000}, None),
        ("max_tokens_beyond_context_completions", "POST", "/v1/completions",
         {"model": MODEL, "prompt": PROMPT, "max_tokens": 100000}, None),
        ("prompt_plus_max_tokens_beyond_context", "POST", "/v1/completions",
         {"model": MODEL, "prompt": mid_prompt, "max_tokens": 1000, "ignore_eos": True}, None),
        ("prompt_too_long", "POST", "/v1/completions",
         {"model": MODEL, "prompt": long_prompt, "max_tokens": 4}, None),
        ("malformed_json", "POST", "/v1/chat/completions", None, b'{"model": "tiny-llama", "messages": ['),
        ("max_tokens_wrong_type", "POST", "/v1/chat/completions",
         {"model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": "lots"}, None),
        ("max_tokens_negative", "POST", "/v1/chat/completions",
         {"model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": -5}, None),
        ("missing_messages", "POST", "/v1/chat/completions", {"model": MODEL, "max_tokens": 4}, None),
        # Sampling checks a degrade's rewrite (min_tokens) or a client's body can run into.
        ("min_tokens_above_max_tokens", "POST", "/v1/chat/completions",
         {"model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": 8, "min_tokens": 10}, None),
        ("top_logprobs_without_logprobs", "POST", "/v1/chat/completions",
         {"model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": 4, "top_logprobs": 3}, None),
        ("top_logprobs_over_20", "POST", "/v1/chat/completions",
         {"model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": 4, "logprobs": True, "top_logprobs": 30}, None),
        ("empty_prompt", "POST", "/v1/completions", {"model": MODEL, "prompt": "", "max_tokens": 4}, None),
        # Tools on a server started without --enable-auto-tool-choice / --tool-call-parser (as here): refused.
        ("tools_without_tool_parser", "POST", "/v1/chat/completions",
         {"model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": 4, "tools": TOOLS}, None),
        ("tool_choice_required_without_tool_parser", "POST", "/v1/chat/completions",
         {"model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": 4, "tools": TOOLS, "tool_choice": "required"},
         None),
        ("tool_choice_named_without_tool_parser", "POST", "/v1/chat/completions",
         {"model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": 4, "tools": TOOLS,
          "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, None),
        ("tool_choice_without_tools", "POST", "/v1/chat/completions",
         {"model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": 4, "tool_choice": "auto"}, None),
        ("tools_empty", "POST", "/v1/chat/completions",
         {"model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": 4, "tools": []}, None),
        ("unknown_path", "POST", "/v1/nope", {"model": MODEL}, None),
        ("wrong_method", "GET", "/v1/chat/completions", None, None),
    ]
    errors = {}
    for name, method, path, body, raw in cases:
        s, h, payload, _ = client.request(method, path, body=body, raw=raw)
        try:
            decoded = json.loads(payload)
        except ValueError:
            decoded = None
        shown_body = body
        if body and body.get("prompt") is long_prompt:
            shown_body = body | {"prompt": "admission admission ... (2100 words)"}
        if body and body.get("prompt") is mid_prompt:
            shown_body = body | {"prompt": "admission admission ... (1500 words)"}
        errors[name] = {
            "request": {"method": method, "path": path,
                        "body": shown_body if raw is None else None,
                        "raw_body": raw.decode() if raw is not None else None},
            "status": s, "headers": header_record(h, keep_length=True),
            "shape": shape(decoded) if decoded is not None else None,
            "body": normalize(decoded) if decoded is not None else payload.decode(errors="replace"),
        }
    write("errors.json", errors)

    # abort, perf, then metrics (so the abort and the perf requests show in the histograms)
    abort = abort_stream(client)
    write("abort.json", abort)
    if do_perf:
        write("perf.json", perf(client) | {"first_chat_request_after_start_s": round(first_chat_seconds, 4),
                                           "second_chat_request_s": round(second_chat_seconds, 4)})
    text = get_metrics(client)
    summary = parse_metrics(text)
    all_samples = {s for f in summary.values() for s in f["samples"]}
    write("metrics.json", {
        "required_samples": {s: s in all_samples for s in REQUIRED_SAMPLES},
        "finished_reasons_seen": sorted(k.split("=", 1)[1] for k in
                                        metric_values(text, "vllm:request_success_total")),
        "families": {k: v for k, v in summary.items() if k.startswith("vllm:")},
        "other_families": {k: {"type": v["type"], "labels": v["labels"]} for k, v in summary.items()
                           if not k.startswith("vllm:")},
    })
    write("metrics.txt", text)


def typed_events(raw: bytes) -> list[dict]:
    """A Responses API stream: `event: <type>` then `data: <json>` per block; each event's type, shape and body
    (volatile values as placeholders)."""
    out = []
    for block in raw.decode("utf-8").split("\n\n"):
        if not block:
            continue
        fields = dict(line.split(": ", 1) for line in block.split("\n") if ": " in line)
        doc = json.loads(fields["data"]) if "data" in fields else None
        formats: dict = {}
        out.append({"event": fields.get("event"), "lines": [ln.split(":", 1)[0] for ln in block.split("\n")],
                    "shape": shape(doc) if doc is not None else None,
                    "body": normalize(doc, formats=formats) if doc is not None else None, "formats": formats})
    return out


def record_api(client: Client, out: Path) -> None:
    """api_*.json: what the simulator long did not serve, recorded so that it can be compared (tests/sim/
    test_parity.py): n > 1 and prompt lists, the Responses API, /tokenize and /detokenize, echo, logprobs,
    response_format, and the refusals around them."""
    def write(name: str, obj) -> None:
        (out / name).write_text(dumps(obj))
        print(f"[record] {name}")

    sample = {"temperature": 1.0}  # vLLM refuses n > 1 under greedy sampling
    cases = {
        "chat_n2": ("/v1/chat/completions", {"model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": 5, "n": 2,
                                             "ignore_eos": True} | sample),
        "chat_n2_default_temperature": ("/v1/chat/completions", {"model": MODEL, "messages": CHAT_MESSAGES,
                                                                 "max_tokens": 3, "n": 2, "ignore_eos": True}),
        "completions_n2": ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "n": 2,
                                               "ignore_eos": True} | sample),
        "completions_prompt_list": ("/v1/completions", {"model": MODEL, "prompt": [PROMPT, "Two"], "max_tokens": 4,
                                                        "ignore_eos": True, "temperature": 0}),
        "completions_prompt_list_n2": ("/v1/completions", {"model": MODEL, "prompt": [PROMPT, "Two"], "n": 2,
                                                           "max_tokens": 3, "ignore_eos": True} | sample),
        "completions_token_lists": ("/v1/completions", {"model": MODEL, "prompt": [[5, 6, 7], [8, 9]],
                                                        "max_tokens": 3, "ignore_eos": True, "temperature": 0}),
        "chat_n2_greedy": ("/v1/chat/completions", {"model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": 4,
                                                    "n": 2, "temperature": 0}),
        "completions_n2_greedy": ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "n": 2,
                                                      "temperature": 0}),
        "chat_n0": ("/v1/chat/completions", {"model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": 4, "n": 0}),
        "prompt_empty_list": ("/v1/completions", {"model": MODEL, "prompt": [], "max_tokens": 4}),
        "prompt_list_with_empty": ("/v1/completions", {"model": MODEL, "prompt": ["a", ""], "max_tokens": 4}),
        "suffix": ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "suffix": "end", "max_tokens": 4}),
        "echo": ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "echo": True, "max_tokens": 3,
                                     "temperature": 0, "ignore_eos": True}),
        "echo_max_tokens_0": ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "echo": True, "max_tokens": 0}),
        "echo_max_tokens_0_logprobs": ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "echo": True,
                                                           "max_tokens": 0, "logprobs": 1}),
        "max_tokens_0": ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 0}),
        "completions_logprobs": ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 3,
                                                     "logprobs": 2, "temperature": 0, "ignore_eos": True}),
        "chat_logprobs": ("/v1/chat/completions", {"model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": 3,
                                                   "logprobs": True, "top_logprobs": 2, "temperature": 0,
                                                   "ignore_eos": True}),
        "chat_logprobs_only": ("/v1/chat/completions", {"model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": 3,
                                                        "logprobs": True, "temperature": 0, "ignore_eos": True}),
        "chat_json_object": ("/v1/chat/completions", {"model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": 20,
                                                      "temperature": 0,
                                                      "response_format": {"type": "json_object"}}),
        "completions_json_object": ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 20,
                                                        "temperature": 0,
                                                        "response_format": {"type": "json_object"}}),
        "responses": ("/v1/responses", {"model": MODEL, "input": "hello there", "max_output_tokens": 5,
                                        "temperature": 0}),
        "responses_messages": ("/v1/responses", {"model": MODEL, "instructions": "Be brief.",
                                                 "input": [{"role": "user", "content": "hello there"}],
                                                 "max_output_tokens": 4, "temperature": 0}),
        "responses_unknown_model": ("/v1/responses", {"model": "no-such-model", "input": "hi",
                                                      "max_output_tokens": 4}),
        "responses_no_input": ("/v1/responses", {"model": MODEL, "max_output_tokens": 4}),
        "tokenize": ("/tokenize", {"model": MODEL, "prompt": PROMPT}),
        "tokenize_chat": ("/tokenize", {"model": MODEL, "messages": CHAT_MESSAGES}),
        "tokenize_no_special": ("/tokenize", {"model": MODEL, "prompt": PROMPT, "add_special_tokens": False}),
        "tokenize_unknown_model": ("/tokenize", {"model": "no-such-model", "prompt": PROMPT}),
        "detokenize": ("/detokenize", {"model": MODEL, "tokens": [5, 6, 7]}),
        "detokenize_unknown_model": ("/detokenize", {"model": "no-such-model", "tokens": [5]}),
    }
    recs = {}
    for name, (path, body) in cases.items():
        s, h, payload, _ = client.request("POST", path, body=body)
        recs[name] = any_record({"method": "POST", "path": path, "body": body}, s, h, payload)
    write("api.json", recs)
    streams = {
        "chat_stream_n2": ("/v1/chat/completions", {"model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": 3,
                                                    "n": 2, "stream": True, "ignore_eos": True,
                                                    "stream_options": {"include_usage": True}} | sample),
        "completions_stream_list_n2": ("/v1/completions", {"model": MODEL, "prompt": [PROMPT, "Two"], "n": 2,
                                                           "max_tokens": 3, "stream": True, "ignore_eos": True,
                                                           "stream_options": {"include_usage": True}} | sample),
        "completions_stream_list": ("/v1/completions", {"model": MODEL, "prompt": [PROMPT, "Two"], "max_tokens": 2,
                                                        "stream": True, "ignore_eos": True, "temperature": 0}),
        "completions_stream_logprobs": ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2,
                                                            "logprobs": 1, "stream": True, "ignore_eos": True,
                                                            "temperature": 0}),
        "chat_stream_logprobs": ("/v1/chat/completions", {"model": MODEL, "messages": CHAT_MESSAGES,
                                                          "max_tokens": 2, "logprobs": True, "top_logprobs": 1,
                                                          "stream": True, "ignore_eos": True, "temperature": 0}),
        "completions_stream_echo": ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2,
                                                        "echo": True, "stream": True, "ignore_eos": True,
                                                        "temperature": 0}),
    }
    out_streams = {}
    for name, (path, body) in streams.items():
        out_streams[name] = stream_doc(path, body, *client.stream(path, body)[:3])
    write("api_streams.json", out_streams)
    body = {"model": MODEL, "input": "hello there", "max_output_tokens": 5, "temperature": 0, "stream": True}
    status, headers, raw, _ = client.stream("/v1/responses", body)
    write("responses_stream.json", {"request": {"method": "POST", "path": "/v1/responses", "body": body},
                                    "status": status, "headers": header_record(headers),
                                    "events": typed_events(raw)})


def overload(client: Client, max_num_seqs: int, max_queued: int) -> dict:
    """Against a server started with --max-num-seqs N --max-num-queued-reqs Q: fill it with long streams, watch
    running/waiting, then record the 503 that vLLM's own admission limit answers."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1800, "stream": True, "ignore_eos": True}
    payload = json.dumps(body).encode()
    socks = []
    for _ in range(max_queued):
        s = socket.create_connection((client.host, client.port), timeout=30)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
        socks.append(s)
    try:
        gauges = {}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            text = get_metrics(client)
            gauges = {n: sum(metric_values(text, n).values())
                      for n in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")}
            if gauges["vllm:num_requests_running"] + gauges["vllm:num_requests_waiting"] >= max_queued:
                break
            time.sleep(0.05)
        waiting_by_reason = metric_values(get_metrics(client), "vllm:num_requests_waiting_by_reason")
        req = {"model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": 4}
        s1, h1, p1, dt1 = client.request("POST", "/v1/chat/completions", req)
        s2, h2, p2, dt2 = client.request("POST", "/v1/completions", {"model": MODEL, "prompt": PROMPT,
                                                                     "max_tokens": 4, "stream": True})
        rejections = metric_values(get_metrics(client), "vllm:admission_rejections_total")
    finally:
        for s in socks:
            s.close()

    def rec(method, path, body, status, headers, payload, dt):
        try:
            decoded = json.loads(payload)
        except ValueError:
            decoded = payload.decode(errors="replace")
        return {"request": {"method": method, "path": path, "body": body}, "status": status,
                "headers": header_record(headers, keep_length=True),
                "shape": shape(decoded) if not isinstance(decoded, str) else None, "body": decoded,
                "seconds": round(dt, 4)}

    return {
        "server_args": ["--max-num-seqs", str(max_num_seqs), "--max-num-queued-reqs", str(max_queued)],
        "held_streams": max_queued,
        "gauges_when_full": gauges,
        "num_requests_waiting_by_reason_when_full": waiting_by_reason,
        "rejected_chat": rec("POST", "/v1/chat/completions", req, s1, h1, p1, dt1),
        "rejected_completions_stream": rec("POST", "/v1/completions",
                                           {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True},
                                           s2, h2, p2, dt2),
        "admission_rejections_total_after": rejections,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="use a running server instead of starting one")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--no-perf", action="store_true")
    ap.add_argument("--no-overload", action="store_true",
                    help="skip overload.json (it starts a second server with small queue limits)")
    ap.add_argument("--no-lora", action="store_true",
                    help="skip lora*.json (it starts a server with --enable-lora and the adapters of build_lora.py)")
    ap.add_argument("--only-lora", action="store_true", help="record lora*.json and nothing else")
    ap.add_argument("--lora-url", help="a running server started with the arguments and environment of "
                                       "lora.json's server_args / server_env, for lora*.json")
    ap.add_argument("--overload-url", help="a running server started with --max-num-seqs 2 "
                                           "--max-num-queued-reqs 4, for overload.json")
    ap.add_argument("--only-api", action="store_true", help="record api*.json and responses_stream.json only")
    args = ap.parse_args(argv)
    seqs, queued = 2, 4
    if args.only_api:
        if args.url:
            record_api(Client(args.url), args.out)
        else:
            with VLLMServer() as server:
                print(f"[record] vLLM healthy after {server.startup_seconds:.1f}s at {server.url}")
                record_api(Client(server.url), args.out)
        return 0
    if not args.only_lora:
        if args.url:
            record(Client(args.url), args.out, not args.no_perf)
        else:
            with VLLMServer() as server:
                print(f"[record] vLLM healthy after {server.startup_seconds:.1f}s at {server.url}")
                record(Client(server.url), args.out, not args.no_perf)
        if args.overload_url:
            (args.out / "overload.json").write_text(dumps(overload(Client(args.overload_url), seqs, queued)))
            print("[record] overload.json")
        elif not args.no_overload and not args.url:
            extra = ["--max-num-seqs", str(seqs), "--max-num-queued-reqs", str(queued)]
            with VLLMServer(extra_args=extra) as server:
                print(f"[record] second vLLM ({' '.join(extra)}) healthy after {server.startup_seconds:.1f}s")
                (args.out / "overload.json").write_text(dumps(overload(Client(server.url), seqs, queued)))
                print("[record] overload.json")
    if args.lora_url:
        record_lora(Client(args.lora_url), args.out)
    elif not args.no_lora and not args.url:
        extra = LORA_SERVER_ARGS + ["--lora-modules", *LORA_MODULES]
        with VLLMServer(extra_args=extra, extra_env=LORA_ENV) as server:
            print(f"[record] LoRA vLLM healthy after {server.startup_seconds:.1f}s")
            record_lora(Client(server.url), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
