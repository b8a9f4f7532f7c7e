#!/usr/bin/env python3
"""Record which generated pooling-route bodies vLLM 0.32's request models take into
tests/fixtures/vllm/pooling_readings.json.

    .cache/vllm-venv/bin/python scripts/vllm/pooling_readings.py          # (make vllm-setup first; ~5 s)

For each route's request type (the union FastAPI validates the body against: /v1/embeddings' EmbeddingRequest,
/pooling's PoolingRequest, /classify's ClassificationRequest, /score's ScoreRequest, /rerank's RerankRequest), the
fields that say what is pooled, each absent or set to a value of every JSON type, alone and (score, rerank) in the
pairs a request needs, validated as FastAPI validates them (pydantic, lax). `valid`: the model took the body;
`refused`: its first error line. No server or model runs: what the renderer refuses later (an empty conversation)
is not recorded. tests/unit/test_openai_body.py checks the gateway's pooling check against the file.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "vllm" / "pooling_readings.json"

ABSENT = "<absent>"
MESSAGES = [{"role": "user", "content": "hi"}]
VALUES = [ABSENT, None, "hi", "", [], [5], [[5]], ["a"], 5, True, {}, {"type": "text", "text": "x"}, MESSAGES,
          [MESSAGES]]
FIELDS = {"/v1/embeddings": ["input", "messages"], "/pooling": ["input", "messages", "data"],
          "/classify": ["input", "messages"],
          "/score": ["queries", "documents", "items", "text_1", "text_2", "data_1", "data_2"],
          "/rerank": ["query", "documents"]}
PAIRS = {"/score": [("queries", "documents"), ("queries", "items"), ("text_1", "text_2"), ("data_1", "data_2")],
         "/rerank": [("query", "documents")]}


def bodies(path: str) -> list[dict]:
    out = [{}]
    for field in FIELDS[path]:
        out += [{field: v} for v in VALUES if v != ABSENT]
    for a, b in PAIRS.get(path, []):
        out += [{a: va, b: vb} for va in VALUES[1:] for vb in (None, "hi", ["a"], 5, {})]
        out += [{a: "hi", b: vb} for vb in VALUES[1:]]
    return out


def main() -> int:
    from pydantic import TypeAdapter, ValidationError

    import vllm
    from vllm.entrypoints.pooling.classify.protocol import ClassificationRequest
    from vllm.entrypoints.pooling.embed.protocol import EmbeddingRequest
    from vllm.entrypoints.pooling.pooling.protocol import PoolingRequest
    from vllm.entrypoints.pooling.scoring.protocol import RerankRequest, ScoreRequest

    models = {"/v1/embeddings": EmbeddingRequest, "/pooling": PoolingRequest, "/classify": ClassificationRequest,
              "/score": ScoreRequest, "/rerank": RerankRequest}
    cases = []
    for path, model in models.items():
        adapter = TypeAdapter(model)
        for fields in bodies(path):
            body = {"model": "m", **fields}
            try:
                adapter.validate_python(json.loads(json.dumps(body)))
                cases.append({"path": path, "body": body, "valid": True})
            except ValidationError as e:
                cases.append({"path": path, "body": body, "valid": False, "refused": str(e).splitlines()[0]})
    head = {"vllm": vllm.__version__, "regenerate": ".cache/vllm-venv/bin/python scripts/vllm/pooling_readings.py"}
    lines = ",\n".join(json.dumps(c) for c in cases)  # one case a line, for readable diffs
    OUT.write_text(json.dumps(head)[:-1] + ', "cases": [\n' + lines + "\n]}\n")
    print(f"{len(cases)} bodies ({sum(not c['valid'] for c in cases)} refused by vLLM) -> {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
