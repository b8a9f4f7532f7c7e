"""The recorded real-vLLM fixtures (tests/fixtures/vllm/) are present and well-formed.

Fast and offline: it reads files only. Re-record with `python3 -m scripts.vllm.record_fixtures` (needs the vLLM
venv, see docs/vllm.md). The simulator's parity test compares against these files; this test only guards their
format (described in tests/fixtures/vllm/README.md).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from scripts.vllm import serve

FIX = Path(__file__).resolve().parent / "fixtures" / "vllm"

JSON_FILES = [
    "health.json", "version.json", "models.json",
    "chat.json", "chat_stop.json", "chat_small_model.json", "completions.json",
    "chat_stream.json", "chat_stream_usage.json", "chat_stream_continuous_usage.json", "chat_stream_stop.json",
    "completions_stream.json", "completions_stream_usage.json",
    "errors.json", "abort.json", "overload.json", "metrics.json", "lora.json", "lora_metrics.json",
]
STREAM_FILES = [f for f in JSON_FILES if "_stream" in f]
EVENT_KINDS = {"role", "content", "finish", "usage", "done"}
USAGE_KEYS = {"prompt_tokens", "completion_tokens", "total_tokens"}
ERROR_CASES = ["unknown_model", "unknown_model_completions", "max_tokens_beyond_context",
               "max_tokens_beyond_context_completions", "prompt_too_long", "malformed_json",
               "max_tokens_wrong_type", "max_tokens_negative", "missing_messages"]
REQUIRED_METRICS = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:request_success_total", "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:inter_token_latency_seconds", "vllm:request_queue_time_seconds", "vllm:iteration_tokens_total",
]


def load(name: str):
    return json.loads((FIX / name).read_text())


@pytest.mark.parametrize("name", JSON_FILES + ["metrics.txt", "README.md"])
def test_present(name):
    assert (FIX / name).is_file(), f"missing fixture {name}"


@pytest.mark.parametrize("name", JSON_FILES)
def test_json_parses(name):
    assert isinstance(load(name), dict)


@pytest.mark.parametrize("name,obj", [("chat.json", "chat.completion"), ("chat_stop.json", "chat.completion"),
                                      ("chat_small_model.json", "chat.completion"),
                                      ("completions.json", "text_completion")])
def test_non_streaming(name, obj):
    fx = load(name)
    assert fx["status"] == 200
    assert fx["headers"]["content-type"] == "application/json"
    assert fx["request"]["method"] == "POST" and fx["request"]["body"]["model"]
    shape, body = fx["shape"], fx["body"]
    assert {"id", "object", "created", "model", "choices", "usage"} <= set(shape)
    assert body["object"] == obj
    assert shape["created"] == "int" and shape["id"] == "str"
    assert USAGE_KEYS <= set(shape["usage"]) and all(shape["usage"][k] == "int" for k in USAGE_KEYS)
    assert body["choices"][0]["finish_reason"] in {"stop", "length"}
    assert re.match(fx["formats"]["$.id"], body["id"].replace("<hex>", "0abc"))
    u = body["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]


@pytest.mark.parametrize("name", STREAM_FILES)
def test_streams(name):
    fx = load(name)
    assert fx["status"] == 200
    assert fx["headers"]["content-type"].startswith("text/event-stream")
    fr = fx["framing"]
    assert fr["prefix"] == "data: " and fr["separator"] == "\n\n" and fr["ends_with_done"]
    assert fr["all_events_prefixed"] and fr["other_lines"] == []
    kinds = [e["kind"] for e in fx["events"]]
    assert set(kinds) <= EVENT_KINDS
    assert kinds[-1] == "done" and kinds.count("done") == 1 and kinds.count("finish") == 1
    assert fx["counts"] == {k: kinds.count(k) for k in dict.fromkeys(kinds)}
    for ev in fx["events"]:
        assert ev["usage"] in {"absent", "null", "object", "n/a"}
        if ev["kind"] != "done":
            assert isinstance(ev["shape"], dict) and isinstance(ev["body"], dict)
            assert set(ev["shape"]) == set(ev["body"])
    wants_usage = fx["request"]["body"].get("stream_options", {}).get("include_usage", False)
    assert ("usage" in kinds) == wants_usage
    if wants_usage:
        usage_ev = next(e for e in fx["events"] if e["kind"] == "usage")
        assert usage_ev["body"]["choices"] == [] and USAGE_KEYS <= set(usage_ev["body"]["usage"])
        assert kinds.index("usage") == len(kinds) - 2  # right before [DONE]
    if name.startswith("chat_"):
        assert kinds[0] == "role"


def test_errors():
    errs = load("errors.json")
    for case in ERROR_CASES:
        e = errs[case]
        assert 400 <= e["status"] < 600, case
        assert e["headers"]["content-type"] == "application/json", case
        assert set(e["body"]["error"]) == {"message", "type", "param", "code"}, case
        assert e["body"]["error"]["code"] == e["status"], case
    assert errs["unknown_model"]["status"] == 404


def test_overload():
    ov = load("overload.json")
    for key in ("rejected_chat", "rejected_completions_stream"):
        assert ov[key]["status"] == 503
        assert set(ov[key]["body"]["error"]) == {"message", "type", "param", "code"}


def test_abort():
    ab = load("abort.json")
    assert isinstance(ab["abort_counted"], bool)
    assert ab["num_requests_running_after"]


def test_metrics():
    m = load("metrics.json")
    assert all(m["required_samples"].values()), m["required_samples"]
    assert {"stop", "length", "abort"} <= set(m["finished_reasons_seen"])
    for fam in m["families"].values():
        assert fam["type"] in {"counter", "gauge", "histogram", "summary", "info", "untyped"}
    text = (FIX / "metrics.txt").read_text()
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.M))
    for name in REQUIRED_METRICS:
        assert name in types, name
    assert types["vllm:num_requests_running"] == "gauge"
    assert types["vllm:request_success_total"] == "counter"
    assert types["vllm:e2e_request_latency_seconds"] == "histogram"
    assert re.search(r'^vllm:request_success_total\{[^}]*finished_reason="abort"', text, flags=re.M)


def test_health_models_version():
    h = load("health.json")
    assert h["status"] == 200 and h["body"] == ""
    models = load("models.json")
    assert models["body"]["object"] == "list"
    assert [d["id"] for d in models["body"]["data"]] == ["tiny-llama", "tiny-llama-small"]
    assert load("version.json")["body"]["version"]


# --------------------------------------------------------------------------- the server, without vLLM installed
def test_lora():
    fx = load("lora.json")
    assert fx["server_env"] == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"} and "--enable-lora" in fx["server_args"]
    statuses = {"models": 200, "chat_a1": 200, "chat_a3": 200, "chat_unknown_model": 404, "load_a2": 200, "chat_a2": 200,
                "load_a2_again": 400, "load_missing_path": 404, "unload_a2": 200, "chat_a2_after_unload": 404,
                "unload_a2_again": 404}
    assert {k: fx[k]["status"] for k in statuses} == statuses
    assert [c["id"] for c in fx["models_after_load"]["body"]["data"]] == ["tiny-llama", "tiny-llama-small", "a1", "a3", "a2"]
    assert fx["load_a2"]["text"].startswith("Success: ") and fx["load_a2"]["shape"] is None
    assert [(c["id"], c["parent"]) for c in fx["models"]["body"]["data"][2:]] == [("a1", "tiny-llama"),
                                                                                ("a3", "tiny-llama-small")]
    metrics = load("lora_metrics.json")
    assert metrics["deferred"]["while_both_held"]["num_requests_waiting_by_reason"]["reason=deferred"] == 1.0


def test_server_command_and_env(tmp_path):
    srv = serve.VLLMServer(port=18123, kv_blocks=24, home=tmp_path)
    cmd = srv.command()
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]  # never the `vllm` console script
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--served-model-name") + 1: cmd.index("--served-model-name") + 3] == \
        ["tiny-llama", "tiny-llama-small"]
    assert "--enforce-eager" in cmd and cmd[cmd.index("--num-gpu-blocks-override") + 1] == "24"
    assert srv.url == "http://127.0.0.1:18123"
    env = serve.vllm_env(tmp_path, kv_cache_gib=1, base={"PATH": "/usr/bin", "PYTHONPATH": "x"})
    for key in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "XDG_CACHE_HOME", "TMPDIR"):
        assert Path(env[key]).is_relative_to(tmp_path), key
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and "PYTHONPATH" not in env


def test_server_refuses_without_venv(tmp_path):
    srv = serve.VLLMServer(port=18124, python=tmp_path / "no-python", home=tmp_path)
    with pytest.raises(serve.VLLMError, match="setup.sh"):
        srv.start()
    srv.stop()  # a no-op, and safe
