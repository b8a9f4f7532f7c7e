"""A small OpenAI-compatible test upstream: controllable delays, SSE, and a count of requests in service.

It exists so the core path can be tested without the simulator's engine model: each request takes
`x-test-delay-ms` (or 0) before its first byte and `x-test-token-ms` per streamed token, and the server records the
highest number of requests it had in service at once, and how many generation requests arrived without the
ext_proc's ticket header (unadmitted: Envoy let them through without a decision).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from aiohttp import ClientConnectionResetError, web


class TestUpstream:
    def __init__(self) -> None:
        self.in_service = 0
        self.max_in_service = 0
        self.served = 0
        self.aborted = 0
        self.unticketed = 0
        self.last_body: dict | None = None
        self.last_headers: dict[str, str] = {}
        self.seen: list[dict] = []  # every request received, as the tests' record of what got past Envoy
        # Admitted requests (with a ticket) in service per class (x-extproc-class), and the most of each since the
        # last GET /test/classes: a test polling it bounds every moment between two reads.
        self.in_class: dict[str, int] = {}
        self.peak_in_class: dict[str, int] = {}
        self.running: dict[int, dict] = {}  # admitted requests in service: their test and extproc headers
        self.peak_detail: dict[str, list] = {}  # per class, those in service at its last peak since the last read

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.record])
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.chat)
        app.router.add_post("/v1/responses", self.chat)
        for path in ("/invocations", "/v1/embeddings", "/pooling", "/classify", "/score", "/v1/score", "/rerank",
                     "/v1/rerank", "/v2/rerank", "/tokenize", "/detokenize"):
            app.router.add_post(path, self.compute)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", lambda r: web.Response())
        app.router.add_get("/test/stats", self.stats)
        app.router.add_post("/test/reset", self.reset)
        app.router.add_get("/test/seen", lambda r: web.json_response(self.seen))
        app.router.add_get("/test/classes", self.classes)
        return app

    @web.middleware
    async def record(self, request: web.Request, handler):
        # Routed like vLLM's server: on the percent-decoded path (aiohttp decodes as uvicorn does).
        if not request.path.startswith("/test/"):
            body = await request.read()
            self.seen.append({"method": request.method, "raw_path": request.raw_path, "path": request.path,
                              "ticket": "x-extproc-ticket" in request.headers,
                              "headers": sorted(k.lower() for k in request.headers),
                              # values too (each cut at 256 characters), and the body as received (its first 16 KiB)
                              "values": [[k.lower(), v[:256]] for k, v in request.headers.items()],
                              "body": body[:16384].decode("latin-1"), "body_len": len(body)})
            del self.seen[:-1000]
        return await handler(request)

    async def compute(self, request: web.Request) -> web.Response:
        self.last_body = json.loads(await request.read())
        self.last_headers = dict(request.headers)
        self.served += 1
        return web.json_response({"object": "list", "data": [], "model": self.last_body.get("model")})

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response({"in_service": self.in_service, "max_in_service": self.max_in_service,
                                  "served": self.served, "aborted": self.aborted, "unticketed": self.unticketed,
                                  "last_body": self.last_body, "last_headers": self.last_headers})

    async def classes(self, request: web.Request) -> web.Response:
        """In service per class now, and the most since the last read (then restarted from now)."""
        out = {"in_service": dict(self.in_class), "peak": dict(self.peak_in_class), "detail": self.peak_detail}
        self.peak_detail = {}
        self.peak_in_class = dict(self.in_class)
        return web.json_response(out)

    async def reset(self, request: web.Request) -> web.Response:
        self.max_in_service = self.in_service
        self.served = self.aborted = self.unticketed = 0
        self.seen.clear()
        return web.json_response({})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "llama-70b", "object": "model"}]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())  # as vLLM's server reads it: Python's json, on the bytes
        self.last_body = body
        self.last_headers = dict(request.headers)
        if "x-extproc-ticket" not in request.headers:
            self.unticketed += 1
        delay = float(request.headers.get("x-test-delay-ms", "0")) / 1000
        token_s = float(request.headers.get("x-test-token-ms", "0")) / 1000
        status = int(request.headers.get("x-test-status", "200"))
        tokens = int(request.headers.get("x-test-tokens") or body.get("max_tokens") or 8)
        self.in_service += 1
        self.max_in_service = max(self.max_in_service, self.in_service)
        cls = request.headers.get("x-extproc-class") if "x-extproc-ticket" in request.headers else None
        if cls is not None:
            self.in_class[cls] = self.in_class.get(cls, 0) + 1
            self.peak_in_class[cls] = max(self.peak_in_class.get(cls, 0), self.in_class[cls])
            self.running[id(request)] = {k: v for k, v in request.headers.items()
                                         if k.lower().startswith(("x-extproc-", "x-test-"))} | {"t": time.time()}
            if self.in_class[cls] > len(self.peak_detail.get(cls, [])):
                self.peak_detail[cls] = [v for v in self.running.values() if v.get("x-extproc-class") == cls]
        try:
            await asyncio.sleep(delay)
            if status != 200:
                return web.json_response({"error": {"message": "injected", "type": "test", "param": None,
                                                    "code": status}}, status=status)
            cap = body.get("max_completion_tokens") or body.get("max_tokens")
            # vLLM's SamplingParams check, its 400 (a cap of "4" is vLLM's lax int, not compared here)
            if isinstance(cap, int) and (body.get("min_tokens") or 0) > cap:
                return web.json_response({"error": {"message": f"min_tokens must be less than or equal to "
                                                    f"max_tokens={cap}, got {body['min_tokens']}.",
                                                    "type": "BadRequestError", "param": None, "code": 400}},
                                         status=400)
            if not body.get("stream"):
                await asyncio.sleep(token_s * tokens)
                self.served += 1
                return await answer(request, body["model"], tokens)
            resp = web.StreamResponse(headers={"content-type": "text/event-stream; charset=utf-8"})
            await resp.prepare(request)
            for i in range(tokens):
                chunk = {"id": "chatcmpl-test", "object": "chat.completion.chunk", "model": body["model"],
                         "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await asyncio.sleep(token_s)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            self.served += 1
            return resp
        except (asyncio.CancelledError, ConnectionResetError, ClientConnectionResetError):
            self.aborted += 1
            raise
        finally:
            self.in_service -= 1
            if cls is not None:
                self.in_class[cls] -= 1
                self.running.pop(id(request), None)


# One token's logprobs entry, as vLLM writes it with top_logprobs (its alternatives left out).
LOGPROB = {"token": "x", "logprob": -0.25, "bytes": [120], "top_logprobs": []}


async def answer(request: web.Request, model: str, tokens: int) -> web.StreamResponse:
    """A non-streamed answer of `tokens` tokens. `x-test-logprobs-bytes` adds about that many bytes of logprobs
    before its usage (vLLM's top_logprobs 20 are ~1.2 KB a token); `x-test-chunked` sends it in 64 KiB writes
    without a content-length, as a server that streams its JSON does."""
    pad = int(request.headers.get("x-test-logprobs-bytes", "0"))
    logprobs = {"content": [LOGPROB] * (pad // len(json.dumps(LOGPROB)))} if pad else None
    doc = {"id": "chatcmpl-test", "object": "chat.completion", "created": int(time.time()), "model": model,
           "choices": [{"index": 0, "message": {"role": "assistant", "content": "x " * tokens},
                        "logprobs": logprobs, "finish_reason": "length"}],
           "usage": {"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": 5 + tokens}}
    if "x-test-chunked" not in request.headers:
        return web.json_response(doc)
    raw = json.dumps(doc, separators=(",", ":")).encode()  # compact, as vLLM's JSONResponse writes it
    resp = web.StreamResponse(headers={"content-type": "application/json"})
    await resp.prepare(request)
    for at in range(0, len(raw), 64 << 10):
        await resp.write(raw[at:at + (64 << 10)])
    await resp.write_eof()
    return resp


def main() -> None:
    """upstream.py PORT [--cancel-on-disconnect]: with the flag a request whose client (Envoy) went away ends at
    once, as vLLM aborts it, instead of running out its delay."""
    port = int(sys.argv[1])
    web.run_app(TestUpstream().app(), host="127.0.0.1", port=port, print=None, access_log=None,
                handler_cancellation="--cancel-on-disconnect" in sys.argv[2:])


if __name__ == "__main__":
    main()
