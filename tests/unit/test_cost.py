"""Cost estimates, online learning, GPU-second budgets, tenant token buckets and session budgets."""

import math
import random

import pytest

from extproc.policy.admission import ACCEPT, INVALID, QUEUE, REJECT, AdmissionController, RequestFacts
from extproc.policy.cost import (AUDIO_PART_TOKENS, IMAGE_PART_TOKENS, MESSAGE_OVERHEAD_TOKENS, TOKENIZE_MAX_CHARS,
                                 VIDEO_PART_TOKENS, CostModel, prompt_size)
from extproc.policy.limits import Completion, Outcome
from extproc.policy.ratelimit import TokenBucket
from extproc.policy.schema import CostSpec, load_policy, policy_warnings
from tests.conftest import make_policy

SPEC = CostSpec(prefill_s_per_1k_tokens=0.1, decode_s_per_token=0.002, default_max_tokens=512)


def test_chat_prompt_counts_text_parts_images_and_tools():
    doc = {"messages": [{"role": "system", "content": "x" * 400},
                        {"role": "user", "content": [{"type": "text", "text": "y" * 40},
                                                     {"type": "image_url", "image_url": {"url": "data:..."}}]}],
           "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}
    chars, tokens = prompt_size(doc)
    assert tokens == 2 * MESSAGE_OVERHEAD_TOKENS + IMAGE_PART_TOKENS
    assert chars > 440
    assert CostModel(SPEC).prompt_tokens(doc) == tokens + -(-chars // 4)


BIG = "w" * 200_000
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": BIG}}


# Every text vLLM puts into the prompt, in each form it takes one: a 200,000-character text in any of them was
# charged a handful of tokens.
@pytest.mark.parametrize("doc", [
    pytest.param({"messages": [{"role": "user", "content": [BIG]}]}, id="bare string in a content list"),
    *(pytest.param({"messages": [{"role": "assistant", "content": [part]}]}, id=part["type"]) for part in (
        {"type": "output_text", "text": BIG}, {"type": "input_text", "text": BIG},
        {"type": "refusal", "refusal": BIG}, {"type": "thinking", "thinking": BIG, "signature": "s"})),
    pytest.param({"messages": [{"role": "assistant", "content": "", "reasoning": BIG}]}, id="reasoning"),
    pytest.param({"messages": [{"role": "assistant", "reasoning_content": BIG}]}, id="reasoning_content"),
    pytest.param({"messages": [{"role": "assistant", "tool_calls": [CALL]}]}, id="tool call arguments"),
    pytest.param({"input": [{"type": "function_call_output", "call_id": "c1", "output": BIG}]},
                 id="responses function_call_output"),
    pytest.param({"input": [{"type": "function_call_output", "call_id": "c1",
                             "output": [{"type": "input_text", "text": BIG}]}]}, id="responses output parts"),
    pytest.param({"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": BIG}]},
                 id="responses function_call"),
    pytest.param({"input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": BIG}]}]},
                 id="responses input message"),
    pytest.param({"input": [{"type": "message", "role": "assistant",
                             "content": [{"type": "output_text", "text": BIG, "annotations": []}]}]},
                 id="responses output message"),
    pytest.param({"input": [{"type": "reasoning", "id": "r1", "summary": [{"type": "summary_text", "text": BIG}]}]},
                 id="responses reasoning summary"),
    # vLLM hands a chat body's RAG documents to the chat template, which writes them into the prompt
    pytest.param({"messages": [{"role": "user", "content": "q"}], "documents": [{"title": "t", "text": BIG}]},
                 id="chat documents"),
    # a Responses body's earlier conversation in harmony form (gpt-oss), which vLLM puts before its input
    pytest.param({"input": "q",
                  "previous_input_messages": [{"role": "user", "content": [{"type": "text", "text": BIG}]}]},
                 id="responses previous_input_messages"),
])
def test_every_text_that_reaches_the_prompt_is_counted(doc):
    chars, _ = prompt_size(doc)
    assert chars >= len(BIG)
    assert CostModel(SPEC).prompt_tokens(doc) >= len(BIG) // 4


def test_reasoning_content_is_not_counted_twice_beside_reasoning():
    # vLLM reads `reasoning`, else `reasoning_content`
    both = {"messages": [{"role": "assistant", "reasoning": "r" * 100, "reasoning_content": "r" * 100}]}
    assert prompt_size(both) == (100, MESSAGE_OVERHEAD_TOKENS)


def test_tool_call_arguments_sent_as_an_object_count_as_their_json():
    doc = {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"a": "x"}}}]}]}
    assert prompt_size(doc)[0] == len("f") + len('{"a":"x"}')


DATA_URL = "data:image/png;base64," + "A" * 200_000


@pytest.mark.parametrize("part, tokens", [
    ({"type": "image_url", "image_url": {"url": DATA_URL}}, IMAGE_PART_TOKENS),
    ({"type": "input_image", "image_url": DATA_URL}, IMAGE_PART_TOKENS),
    ({"type": "input_audio", "input_audio": {"data": "A" * 200_000, "format": "wav"}}, AUDIO_PART_TOKENS),
    ({"type": "input_file", "file_data": "A" * 200_000}, 0),
    ({"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}, VIDEO_PART_TOKENS),
    ({"type": "image_embeds", "image_embeds": "A" * 200_000}, IMAGE_PART_TOKENS),
    ({"image_url": {"url": DATA_URL}}, IMAGE_PART_TOKENS),   # no type: vLLM reads the media key
    ({"video_url": "https://example.com/v.mp4", "uuid": None}, VIDEO_PART_TOKENS),
])
def test_media_payloads_are_never_counted_as_text(part, tokens):
    for doc in ({"messages": [{"role": "user", "content": [part]}]},
                {"input": [{"type": "message", "role": "user", "content": [part]}]}):
        assert prompt_size(doc) == (0, MESSAGE_OVERHEAD_TOKENS + tokens)


@pytest.mark.parametrize("doc", [
    {"model": "e", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": DATA_URL}},
                                                             {"type": "text", "text": "a cat"}]}]},
    {"model": "e", "messages": [{"role": "user", "content": [{"image_url": {"url": DATA_URL}}]}]},
    {"model": "r", "query": "a cat", "documents": {"content": [{"type": "image_url", "image_url": {"url": DATA_URL}}]}},
])
def test_a_pooling_bodys_media_payloads_count_as_media_not_as_text(doc):
    # An embeddings (or score, rerank, tokenize) body is costed from all its text; an image's base64 data URL was
    # text too: a 200 KB image came to 50,000 prompt tokens instead of the image's few hundred.
    assert CostModel(SPEC).prompt_tokens(doc, generates=False) < IMAGE_PART_TOKENS + 100


@pytest.mark.parametrize("generates", [True, False])
def test_a_models_own_media_counts_cost_its_media_parts(generates):
    # A dynamic-resolution vision model (the Qwen2-VL family) fills up to ~16K prompt tokens with one large image;
    # at the fixed 768 ten images were admitted at 7,680 tokens where the replica prefilled 160K.
    image = {"type": "image_url", "image_url": {"url": DATA_URL}}
    video = {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}
    doc = {"messages": [{"role": "user", "content": [image] * 10 + [video]}]}
    base = CostModel(CostSpec(image_tokens=0, video_tokens=0)).prompt_tokens(doc, generates)  # the text around
    vision = CostModel(CostSpec(image_tokens=16_384, video_tokens=8_000))
    assert vision.prompt_tokens(doc, generates) == base + 10 * 16_384 + 8_000
    assert CostModel(SPEC).prompt_tokens(doc, generates) == base + 10 * IMAGE_PART_TOKENS + VIDEO_PART_TOKENS


def test_a_responses_reasoning_items_encrypted_content_is_not_text():
    doc = {"input": [{"type": "reasoning", "summary": [], "encrypted_content": "e" * 10_000}]}
    assert prompt_size(doc) == (0, MESSAGE_OVERHEAD_TOKENS)


def test_completion_prompts_strings_lists_and_token_ids():
    m = CostModel(SPEC)
    assert m.prompt_tokens({"prompt": "z" * 400}) == 100
    assert m.prompt_tokens({"prompt": ["a" * 40, "b" * 40]}) == 20
    assert m.prompt_tokens({"prompt": list(range(77))}) == 77


@pytest.mark.parametrize("text, real_per_char", [
    ("你好，世界。今天天气很好。", 1.0),     # CJK: tokenizers give about a token a character
    ("こんにちは、世界", 1.0),
    ("😀🚀🎉", 1.0),                          # an emoji is one token or more
    ("Привет, как дела? ", 0.3),            # Cyrillic: about 3 characters a token
])
def test_the_fast_estimate_counts_other_scripts_by_their_utf8_size(text, real_per_char):
    """Counted by characters, CJK and emoji were 3-4x low (a quarter token a character): a tenant's token budget
    and the pool's token limit took such prompts at a fraction of their size."""
    m = CostModel(SPEC)
    text = text * 50
    estimate = m.prompt_tokens({"prompt": text})
    assert 0.7 * real_per_char * len(text) <= estimate <= 2.2 * real_per_char * len(text)
    assert estimate == m.prompt_tokens({"prompt": text}, generates=False)  # embeddings and the like alike
    assert m.prompt_tokens({"prompt": "plain ascii " * 50}) == 150  # English unchanged: a byte is a character


def test_chat_template_kwargs_texts_are_prompt_text():
    # vLLM passes chat_template_kwargs to the template, `documents` among them whatever the template (a standard
    # argument), and a RAG template writes them into the prompt: sent there rather than as `documents`, 40,000
    # characters were free. A flag (enable_thinking) is no text.
    m = CostModel(SPEC)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    docs = [{"title": "t", "text": "x" * 40_000}]
    assert m.prompt_tokens({**chat, "chat_template_kwargs": {"documents": docs}}) >= \
        m.prompt_tokens(chat) + 40_000 / SPEC.chars_per_token
    assert m.prompt_tokens({**chat, "chat_template_kwargs": {"enable_thinking": False}}) == m.prompt_tokens(chat)


def test_a_responses_custom_tool_calls_input_is_prompt_text():
    # vLLM writes a custom_tool_call item's `input` into the prompt as the call's arguments: it was free.
    m = CostModel(SPEC)
    call = {"type": "custom_tool_call", "call_id": "c1", "name": "run", "input": "x" * 40_000}
    bare = m.prompt_tokens({"model": "m", "input": [{**call, "input": ""}]})
    assert m.prompt_tokens({"model": "m", "input": [call]}) - bare == 40_000 / SPEC.chars_per_token
    # a chat message's stray `input` key is no such thing
    chat = {"role": "user", "content": "hi", "input": "x" * 40_000}
    assert m.prompt_tokens({"model": "m", "messages": [chat]}) == m.prompt_tokens(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]})


@pytest.mark.parametrize("prompt,copies", [("p", 1), (["p", "q", "r"], 3), ([1, 2, 3], 0)])
def test_a_completions_suffix_is_prompt_text_in_every_prompt_it_is_rendered_into(prompt, copies):
    # vLLM renders `suffix` into each text prompt (fill-in-the-middle, DeepSeek V4's renderer): a 40,000-character
    # suffix beside a one-letter prompt was charged one token of prefill.
    m = CostModel(SPEC)
    suffix = "x" * 40_000
    bare = m.prompt_tokens({"model": "m", "prompt": prompt})
    with_suffix = m.prompt_tokens({"model": "m", "prompt": prompt, "suffix": suffix})
    assert with_suffix - bare == pytest.approx(copies * len(suffix) / SPEC.chars_per_token, abs=1)


@pytest.mark.parametrize("query,documents", [("query", "documents"), ("text_1", "text_2"), ("queries", "documents"),
                                             ("data_1", "data_2"), ("queries", "items")])
def test_a_score_or_rerank_query_counts_once_per_document_it_is_paired_with(query, documents):
    # vLLM runs a cross-encoder on (query, document) pairs: one long query beside 100 one-letter documents is 100
    # prefills of the query. Counted once, it cost 1/100 of what the replica ran. (vLLM 0.32's score request also
    # takes `queries` with `items`, ScoreQueriesItemsRequest: that query was counted once.)
    m = CostModel(SPEC)
    q = "word " * 1_000
    cost = m.prompt_tokens({"model": "r", query: q, documents: ["x"] * 100}, generates=False)
    assert cost >= 100 * len(q) / SPEC.chars_per_token
    assert m.prompt_tokens({"model": "r", query: [q], documents: ["x"] * 100}, generates=False) == cost
    # one document, or as many queries as documents (pairs one to one): each text once, as before
    one = m.prompt_tokens({"model": "r", query: q, documents: ["x"]}, generates=False)
    assert one < 2 * len(q) / SPEC.chars_per_token
    pairs = m.prompt_tokens({"model": "r", query: [q, q], documents: ["x", "y"]}, generates=False)
    assert pairs < 3 * len(q) / SPEC.chars_per_token


def test_a_lone_surrogate_from_a_json_escape_is_counted_not_an_error():
    assert CostModel(SPEC).prompt_tokens({"prompt": "\ud800" * 8}) == 6


def test_missing_max_tokens_takes_the_models_default_and_the_context_clamps():
    m = CostModel(SPEC)
    est = m.estimate(1000, None)
    assert est.max_tokens == 512
    assert est.gpu_seconds == pytest.approx(0.1 + 512 * 0.002)
    clamped = CostModel(CostSpec(max_context_tokens=2048)).estimate(2000, 1000)
    assert clamped.max_tokens == 48


def test_the_most_output_believed_is_the_clients_cap_else_the_context():
    # the assumed default_max_tokens is not a bound on what vLLM generates: its own default is the rest of the context
    assert CostModel(SPEC).estimate(1000, None).most_output == 0  # unknown: the caller's absolute ceiling
    assert CostModel(CostSpec(max_context_tokens=8192)).estimate(1000, None, sequences=2).most_output == 2 * 8192
    # the client's cap, not clamped by a prompt estimate that may be high
    assert CostModel(CostSpec(max_context_tokens=2048)).estimate(2000, 1000).most_output == 1000


def test_variance_margin_widens_the_estimate():
    plain = CostModel(SPEC).estimate(1000, 100).gpu_seconds
    moe = CostModel(CostSpec(prefill_s_per_1k_tokens=0.1, decode_s_per_token=0.002, variance_margin=0.35))
    assert moe.estimate(1000, 100).gpu_seconds == pytest.approx(plain * 1.35)


def test_absurd_max_tokens_is_refused_with_400_when_the_context_is_known():
    core = AdmissionController(make_policy(models={"llama": {"cluster": "a", "cost": {"max_context_tokens": 8192}}}))
    d = core.decide(RequestFacts(model="llama", max_tokens=10**9))
    assert (d.kind, d.status, d.reason) == (INVALID, 400, "max_tokens_too_large")


def test_online_learning_converges_on_a_synthetic_stream():
    m = CostModel(CostSpec(prefill_s_per_1k_tokens=0.05, decode_s_per_token=0.004))
    rng = random.Random(1)
    true_a, true_b = 0.1 / 1000, 0.002  # the real coefficients differ from the configured ones by 2x
    for _ in range(4000):
        p, requested = rng.randint(50, 4000), rng.randint(16, 512)
        done = int(requested * 0.4)
        est = m.estimate(p, requested)
        service = true_a * p + true_b * done
        if rng.random() < 0.02:
            service *= 20  # an outlier (a stalled request) now and then
        m.learn(est, p, done, service)
    assert m.output_ratio == pytest.approx(0.4, abs=0.02)
    assert m.service_prefill == pytest.approx(true_a, rel=0.15)
    assert m.service_decode == pytest.approx(true_b, rel=0.15)
    # Service times fit the SLO's prediction; the GPU-seconds charged stay at the configured coefficients.
    assert (m.prefill_per_token, m.decode_per_token) == (0.05 / 1000, 0.004)
    assert m.service_s(m.estimate(1000, 100)) == pytest.approx(true_a * 1000 + true_b * 40, rel=0.15)


def test_sequences_decoded_together_do_not_teach_a_cheaper_decode():
    # n sequences (and a completions list's prompts) decode side by side: the request lasts as long as its longest
    # sequence, while its usage counts all of them. Fitted against the usage's total, a stream of n=4 requests
    # taught decode_s_per_token a quarter of what it is, and every n=1 request after was costed 4x low.
    m = CostModel(CostSpec(prefill_s_per_1k_tokens=0.1, decode_s_per_token=0.002))
    rng = random.Random(3)
    for _ in range(2000):
        p, requested, n = rng.randint(50, 2000), rng.randint(16, 512), rng.choice((1, 4, 8))
        each = int(requested * 0.5)
        m.learn(m.estimate(p, requested, sequences=n), p, each * n, 0.1 / 1000 * p + 0.002 * each)
    assert m.service_decode == pytest.approx(0.002, rel=0.1)
    assert m.service_prefill == pytest.approx(0.1 / 1000, rel=0.1)
    assert m.output_ratio == pytest.approx(0.5, abs=0.03)  # the ratio is of all sequences' output, as before


def test_an_output_token_costs_more_the_longer_the_context_it_attends_to():
    # decode_s_per_1k_context: each output token reads its sequence's KV cache, its prompt and the output before it.
    m = CostModel(CostSpec(prefill_s_per_1k_tokens=0.01, decode_s_per_token=0.0002, decode_s_per_1k_context=0.0004,
                           learn=False))
    assert m.actual(1000, 100) == pytest.approx(0.01 + 100 * (0.0002 + 0.0004 * (1000 + 50) / 1000))
    # n sequences share their prompt (each attends all of it); a list's prompts are one a sequence.
    assert m.actual(1000, 400, sequences=4) == pytest.approx(4 * (m.actual(1000, 100) - 0.01) + 0.01)
    assert m.actual(2000, 200, sequences=2, prompts=2) == pytest.approx(2 * m.actual(1000, 100))
    # The estimate prices the expected output the same way, and a long prompt's answer dearer a token.
    est = m.estimate(1000, 100)
    assert est.gpu_seconds == pytest.approx(m.actual(1000, 100)) and m.repriced(est) == est.gpu_seconds
    assert m.actual(8000, 100) - m.actual(8000, 0) > 3 * (m.actual(500, 100) - m.actual(500, 0))
    # Without it (the default), an output token costs decode_s_per_token whatever the context.
    flat = CostModel(CostSpec(prefill_s_per_1k_tokens=0.01, decode_s_per_token=0.0002))
    assert flat.actual(8000, 100) - flat.actual(8000, 0) == pytest.approx(100 * 0.0002)


def test_learning_is_bounded_against_garbage():
    m = CostModel(SPEC)
    for _ in range(1000):
        m.learn(m.estimate(100, 100), 100, 100, 1e6)
    assert m.service_decode <= SPEC.decode_s_per_token * 4
    assert m.service_prefill <= SPEC.prefill_s_per_1k_tokens / 1000 * 4


def test_a_coefficient_configured_at_zero_is_bounded_against_garbage_too():
    # Found by the usage model test (test_admission_model_usage.py): a 0 coefficient had no bound at all. One 600 s
    # report of a prompt-only request set a 0 prefill to 0.03 s/token (a 1,000-token prompt estimated at 30
    # GPU-seconds); 200 of a 512-token answer ran a 0 decode up to 0.22 s/token (a 114 GPU-second estimate).
    for spec, prompt, output in ((CostSpec(prefill_s_per_1k_tokens=0.0, decode_s_per_token=0.002), 1000, 0),
                                 (CostSpec(prefill_s_per_1k_tokens=0.1, decode_s_per_token=0.0), 100, 512)):
        m = CostModel(spec)
        for _ in range(200):
            m.learn(m.estimate(prompt, 512), prompt, output, 600.0)
        assert m.service_prefill <= spec.prefill_s_per_1k_tokens / 1000 * 4
        assert m.service_decode <= spec.decode_s_per_token * 4


def budget_core(clock, budget=1.0, **over):
    spec = {"max_concurrency": 100, "max_queue": 5, "max_wait_ms": 1000, "max_inflight_gpu_seconds": budget}
    spec.update(over)
    return AdmissionController(make_policy(
        classes={"interactive": spec}, tenants=[], default_class="interactive",
        models={"llama": {"cluster": "a", "cost": {"prefill_s_per_1k_tokens": 0.1, "decode_s_per_token": 0.001}}}),
        clock=clock)


def facts(prompt_chars, max_tokens, **kw):
    return RequestFacts(model="llama", max_tokens=max_tokens, doc={"prompt": "x" * prompt_chars}, **kw)


def test_budget_admits_until_the_gpu_seconds_run_out_then_queues(clock):
    core = budget_core(clock)  # each request: 1000 tokens prefill 0.1 s + 200 * 0.001 = 0.3 GPU-s
    ds = [core.decide(facts(4000, 200)) for _ in range(4)]
    assert [d.kind for d in ds] == [ACCEPT, ACCEPT, ACCEPT, QUEUE]
    assert core.limiters["interactive"].inflight_cost == pytest.approx(0.9)
    core.finish(ds[0].ticket, Outcome.OK)
    assert ds[3].waiter.result.kind == ACCEPT


def test_one_long_prompt_takes_the_budget_many_short_ones_would(clock):
    core = budget_core(clock, max_queue=0)
    long = core.decide(facts(4 * 8000, 16))          # 0.8 + 0.016 GPU-s
    assert long.kind == ACCEPT
    shorts = [core.decide(facts(160, 16)) for _ in range(20)]  # 0.004 + 0.016 each
    assert sum(d.kind == ACCEPT for d in shorts) == 9
    core.finish(long.ticket, Outcome.OK)
    assert sum(core.decide(facts(160, 16)).kind == ACCEPT for _ in range(50)) == 41  # (1 - 9 * 0.02) / 0.02


def test_a_request_larger_than_the_whole_budget_is_413_not_queued(clock):
    d = budget_core(clock).decide(facts(4 * 20000, 16))
    assert (d.kind, d.status, d.reason) == (REJECT, 413, "request_too_large")
    assert "GPU-seconds" in d.message


def test_token_bucket_refills_at_its_rate(clock):
    b = TokenBucket(rate_per_s=1.0, capacity=10.0, now=0.0)
    b.take(10, 0.0)
    assert b.wait_s(3, 0.0) == pytest.approx(3.0)
    assert b.wait_s(3, 2.0) == pytest.approx(1.0)
    assert b.wait_s(3, 3.0) == 0.0
    assert b.wait_s(11, 3.0) == float("inf")


def tenant_core(clock, **tenant):
    spec = {"name": "acme", "api_keys": ["k"], **tenant}
    return AdmissionController(make_policy(tenants=[spec], shed={}), clock=clock)


def test_tenant_request_rate_limit_is_429_with_retry_after_and_openai_headers(clock):
    core = tenant_core(clock, requests_per_minute=60, burst_s=2)  # bucket of 2 requests, 1/s
    ok = [core.decide(RequestFacts(api_key="k", model="llama", header_class="batch")) for _ in range(2)]
    assert all(d.kind == ACCEPT for d in ok)
    d = core.decide(RequestFacts(api_key="k", model="llama", header_class="batch"))
    assert (d.kind, d.status, d.reason, d.retry_after) == (REJECT, 429, "tenant_requests_per_minute", 1)
    hs = dict(d.headers)
    assert hs["x-ratelimit-limit-requests"] == "60" and hs["x-ratelimit-remaining-requests"] == "0"
    clock.advance(1.0)
    assert core.decide(RequestFacts(api_key="k", model="llama", header_class="batch")).kind == ACCEPT


def test_a_reload_that_changes_a_tenants_limits_does_not_refill_its_bucket(clock):
    core = tenant_core(clock, requests_per_minute=60, burst_s=2)  # bucket of 2 requests, 1/s
    for _ in range(2):
        core.decide(RequestFacts(api_key="k", model="llama", header_class="batch"))
    # The operator raises the burst: the tenant keeps what it had left (nothing), at the new capacity.
    core.apply(make_policy(tenants=[{"name": "acme", "api_keys": ["k"], "requests_per_minute": 60,
                                     "burst_s": 10}], shed={}))
    assert core.decide(RequestFacts(api_key="k", model="llama", header_class="batch")).reason \
        == "tenant_requests_per_minute"
    clock.advance(1.0)
    assert core.decide(RequestFacts(api_key="k", model="llama", header_class="batch")).kind == ACCEPT


def test_what_a_request_in_flight_over_a_tenant_edit_gets_back_goes_to_the_tenants_bucket_in_use(clock):
    # An edited tenant got a new TenantLimits carrying its buckets' levels, but requests charged before the edit
    # settled against the old one: a waiter refused after an API key was added refunded a bucket nobody reads.
    core = tenant_core(clock, requests_per_minute=60, burst_s=5)  # bucket of 5; batch: 3 slots, 5 places
    ds = [core.decide(RequestFacts(api_key="k", model="llama", header_class="batch")) for _ in range(4)]
    assert [d.kind for d in ds] == [ACCEPT] * 3 + [QUEUE]
    core.apply(make_policy(tenants=[{"name": "acme", "api_keys": ["k", "k2"], "requests_per_minute": 60,
                                     "burst_s": 5}], shed={}))
    bucket = core.tenant_limits["acme"].requests
    assert bucket.refill(clock()) == 1
    core.abandon(ds[3].waiter, timed_out=False)  # its client left: the request it prepaid comes back
    assert bucket.refill(clock()) == 2


def test_a_queue_holds_no_more_of_a_tenant_than_its_rate(clock):
    # Checked on arrival but charged only on admission, a burst queued ahead of the limit and was served in full
    # (10 requests/minute: 22 served in 2 s, then refused as queue_full). A queued request now pays on arrival.
    core = tenant_core(clock, requests_per_minute=60, burst_s=5)  # bucket of 5; batch: 3 slots, 5 places
    ds = [core.decide(RequestFacts(api_key="k", model="llama", header_class="batch")) for _ in range(10)]
    assert [d.kind for d in ds] == [ACCEPT] * 3 + [QUEUE] * 2 + [REJECT] * 5
    assert {d.reason for d in ds[5:]} == {"tenant_requests_per_minute"}
    # A queued request that is never admitted gives its share back: the next arrival may queue.
    core.abandon(ds[4].waiter, timed_out=False)
    assert core.decide(RequestFacts(api_key="k", model="llama", header_class="batch")).kind == QUEUE
    # One that is admitted from the queue is not charged twice.
    core.finish(ds[0].ticket, Outcome.OK)
    assert ds[3].waiter.result.kind == ACCEPT
    assert core.decide(RequestFacts(api_key="k", model="llama", header_class="batch")).reason \
        == "tenant_requests_per_minute"
    clock.advance(1.0)
    assert core.decide(RequestFacts(api_key="k", model="llama", header_class="batch")).kind == QUEUE


def test_a_queued_request_answers_with_its_tenants_rate_limit_headers(clock):
    # The x-ratelimit-* headers went only with decisions made on arrival: a request admitted from the queue, or
    # refused when its wait ran out, reached the openai SDK's with_raw_response without them.
    core = tenant_core(clock, requests_per_minute=60, burst_s=10)  # batch: 3 slots, 5 places
    ds = [core.decide(RequestFacts(api_key="k", model="llama", header_class="batch")) for _ in range(5)]
    assert [d.kind for d in ds] == [ACCEPT] * 3 + [QUEUE] * 2
    core.finish(ds[0].ticket, Outcome.OK)
    admitted = ds[3].waiter.result
    assert admitted.kind == ACCEPT
    assert dict(admitted.headers)["x-ratelimit-remaining-requests"] == "5"
    clock.advance(10.0)  # past batch's 5 s wait, 10 requests' worth refilled
    core.reap()
    timed_out = ds[4].waiter.result
    assert (timed_out.kind, timed_out.reason) == (REJECT, "queue_timeout")
    assert dict(timed_out.headers)["x-ratelimit-remaining-requests"] == "10"  # refilled, and refunded in full


def test_tenant_token_limit_is_corrected_by_real_usage(clock):
    core = tenant_core(clock, tokens_per_minute=600, burst_s=60)
    d = core.decide(RequestFacts(api_key="k", model="llama", max_tokens=500, header_class="batch",
                                 doc={"prompt": "x" * 400}))
    assert d.kind == ACCEPT  # charged 100 + 500
    assert core.decide(RequestFacts(api_key="k", model="llama", max_tokens=200, header_class="batch")).kind \
        == REJECT
    core.usage(d.ticket, 100, 50)
    core.finish(d.ticket, Outcome.OK)
    core.report(d.ticket.id, Completion(Outcome.OK, 200, 0.1, 1.0))
    assert core.decide(RequestFacts(api_key="k", model="llama", max_tokens=200, header_class="batch")).kind \
        == ACCEPT  # 450 tokens refunded


def test_real_usage_still_refunds_the_tenant_after_a_reload_removed_the_requests_model(clock):
    # An operator renames a model while its requests run: their usage has no cost model left to teach, but the
    # tenant's worst-case charge (prompt + max_tokens) must still be settled at what the replica produced.
    spec = {"name": "acme", "api_keys": ["k"], "tokens_per_minute": 600, "burst_s": 60}
    core = AdmissionController(make_policy(tenants=[spec], shed={}), clock=clock)
    d = core.decide(RequestFacts(api_key="k", model="llama", max_tokens=500, header_class="batch",
                                 doc={"prompt": "x" * 400}))
    assert d.kind == ACCEPT  # charged 100 + 500
    core.apply(make_policy(tenants=[spec], shed={}, models={"llama-3": {"cluster": "pool_a"},
                                                             "small": {"cluster": "pool_b"}}))
    core.usage(d.ticket, 100, 50)
    core.finish(d.ticket, Outcome.OK)
    core.report(d.ticket.id, Completion(Outcome.OK, 200, 0.1, 1.0))
    assert core.decide(RequestFacts(api_key="k", model="llama-3", max_tokens=200, header_class="batch")).kind \
        == ACCEPT  # 450 tokens refunded


def test_a_request_that_produced_nothing_does_not_cost_the_tenant_its_bucket(clock):
    # Charged prompt + max_tokens up front and refunded only from the usage read; a 400 from the replica (max_tokens
    # past its context) has none, and max_tokens 2**31 locked the tenant out for 36 hours (a hostile-client audit).
    core = tenant_core(clock, tokens_per_minute=1000, burst_s=60)
    huge = core.decide(RequestFacts(api_key="k", model="llama", max_tokens=2**31 - 1, header_class="batch"))
    assert huge.kind == ACCEPT
    blocked = core.decide(RequestFacts(api_key="k", model="llama", max_tokens=10, header_class="batch"))
    assert blocked.kind == REJECT and blocked.retry_after <= 120  # the debt is at most one bucket
    core.finish(huge.ticket, Outcome.OK)
    core.report(huge.ticket.id, Completion(Outcome.OK, 400, 0.01, 0.01))  # the replica refused it: no usage
    d = core.decide(RequestFacts(api_key="k", model="llama", max_tokens=10, header_class="batch"))
    assert d.kind == ACCEPT
    # Given back exactly what was taken (down to the debt floor), not the 2**31 asked: the bucket is where it was.
    assert dict(d.headers)["x-ratelimit-remaining-tokens"] == str(1000 - d.charge.tokens)



def test_an_answer_that_broke_off_is_charged_like_an_abort_not_refunded(clock):
    # A client that stops reading an answer larger than Envoy's buffers is cut by stream_idle_timeout, which the
    # access log reports as the replica's failure (200, then SI): refunding it in full made every such answer free
    # (a hostile-client audit). Refunded: what the replica refused or failed before answering.
    def remaining_after(report: Completion | None) -> int:
        core = tenant_core(clock, tokens_per_minute=1000, burst_s=60)
        core.cost_models["llama"].output_ratio = 0.5
        d = core.decide(RequestFacts(api_key="k", model="llama", max_tokens=400, header_class="batch"))
        core.finish(d.ticket, Outcome.UPSTREAM_ERROR)
        if report is not None:
            core.report(d.ticket.id, report)
        probe = core.decide(RequestFacts(api_key="k", model="llama", max_tokens=10, header_class="batch"))
        return int(dict(probe.headers)["x-ratelimit-remaining-tokens"]) + probe.charge.tokens

    assert remaining_after(Completion(Outcome.UPSTREAM_ERROR, 200, 0.01, None)) == 800  # ~200 expected output kept
    assert remaining_after(Completion(Outcome.UPSTREAM_ERROR, 503, 0.01, 0.01)) == 1000  # refused: all back
    assert remaining_after(Completion(Outcome.UPSTREAM_ERROR, 0, None, None)) == 1000    # reset before an answer


def session_core(clock):
    return AdmissionController(make_policy(
        classes={"batch": {"max_concurrency": 100}}, default_class="batch",
        tenants=[{"name": "a", "api_keys": ["ka"]}, {"name": "b", "api_keys": ["kb"]}], shed={},
        sessions={"max_inflight_gpu_seconds": 1.0},
        models={"llama": {"cluster": "x", "cost": {"prefill_s_per_1k_tokens": 0.1, "decode_s_per_token": 0.001}}}),
        clock=clock)


def test_a_session_shares_one_in_flight_budget_and_others_are_unaffected(clock):
    core = session_core(clock)
    agent = [core.decide(facts(4000, 200, api_key="ka", header_class="batch", session_id="s1")) for _ in range(5)]
    assert [d.kind for d in agent] == [ACCEPT] * 3 + [REJECT] * 2
    assert agent[3].reason == "session_inflight_budget" and agent[3].status == 429
    other = [core.decide(facts(4000, 200, api_key="kb", header_class="batch", session_id="s1")) for _ in range(3)]
    assert all(d.kind == ACCEPT for d in other)  # same id, other tenant: another session
    core.finish(agent[0].ticket, Outcome.OK)
    assert core.decide(facts(4000, 200, api_key="ka", header_class="batch", session_id="s1")).kind == ACCEPT


def test_a_session_with_a_request_queued_is_not_forgotten_for_another(clock):
    # Only sessions with requests in flight were kept past max_sessions: one whose request waited in a queue was
    # forgotten, the request was then admitted against a Session nobody looked up any more, and the session's next
    # request found nothing in flight (and a fresh per-minute bucket).
    core = AdmissionController(make_policy(
        classes={"batch": {"max_concurrency": 1, "max_queue": 5, "max_wait_ms": 5000}}, default_class="batch",
        tenants=[{"name": "a", "api_keys": ["ka"]}], shed={},
        sessions={"max_inflight_gpu_seconds": 0.5, "max_sessions": 1},
        models={"llama": {"cluster": "x", "cost": {"prefill_s_per_1k_tokens": 0.1, "decode_s_per_token": 0.001}}}),
        clock=clock)
    running = core.decide(facts(4000, 200, api_key="ka", header_class="batch"))  # 0.3 GPU-s; no session
    queued = core.decide(facts(4000, 200, api_key="ka", header_class="batch", session_id="s1"))
    other = core.decide(facts(4000, 200, api_key="ka", header_class="batch", session_id="s2"))
    assert queued.kind == other.kind == QUEUE
    core.abandon(other.waiter, timed_out=False)
    core.finish(running.ticket, Outcome.OK)
    assert queued.waiter.result.kind == ACCEPT  # s1 has 0.3 of its 0.5 GPU-s in flight
    assert core.decide(facts(4000, 200, api_key="ka", header_class="batch", session_id="s1")).reason \
        == "session_inflight_budget"
    core.finish(queued.waiter.result.ticket, Outcome.OK)
    assert [(s.inflight, s.queued) for s in core.sessions.sessions.values()] == [(0, 0), (0, 0)]


def session_policy(**sessions):
    """One class, tenant `a`, these session knobs; a request of facts(4000, 200) costs 0.3 GPU-s."""
    return make_policy(classes={"batch": {"max_concurrency": 100}}, default_class="batch", shed={},
                       tenants=[{"name": "a", "api_keys": ["ka"]}], sessions=sessions,
                       models={"llama": {"cluster": "x", "cost": {"prefill_s_per_1k_tokens": 0.1,
                                                                  "decode_s_per_token": 0.001}}})


def test_a_sessions_queued_requests_count_against_its_in_flight_budget(clock):
    # Queued while other sessions filled the class, each fitted the budget with nothing of its session running;
    # granted together when slots freed, 0.6 GPU-s of the session ran at once on a budget of 0.5.
    core = AdmissionController(make_policy(
        classes={"batch": {"max_concurrency": 2, "max_queue": 5, "max_wait_ms": 5000}}, default_class="batch",
        tenants=[{"name": "a", "api_keys": ["ka"]}], shed={}, sessions={"max_inflight_gpu_seconds": 0.5},
        models={"llama": {"cluster": "x", "cost": {"prefill_s_per_1k_tokens": 0.1, "decode_s_per_token": 0.001}}}),
        clock=clock)  # each request: 0.3 GPU-s
    others = [core.decide(facts(4000, 200, api_key="ka", header_class="batch")) for _ in range(2)]
    mine = [core.decide(facts(4000, 200, api_key="ka", header_class="batch", session_id="s1")) for _ in range(2)]
    assert [d.kind for d in mine] == [QUEUE, REJECT] and mine[1].reason == "session_inflight_budget"
    for d in others:
        core.finish(d.ticket, Outcome.OK)
    session = core.sessions.sessions[("a", "s1")]
    assert mine[0].waiter.result.kind == ACCEPT and session.inflight_gpu_s <= 0.5
    core.finish(mine[0].waiter.result.ticket, Outcome.OK)
    assert (session.inflight, session.queued, session.inflight_gpu_s, session.queued_gpu_s) == (0, 0, 0.0, 0.0)


def test_a_reload_that_changes_the_session_knobs_keeps_what_each_session_has_in_flight_and_left(clock):
    # A new SessionBudgets forgot every session: each one's running GPU-seconds (its in-flight budget let a full
    # budget more in at once) and what it had spent of its per-minute bucket (a fresh minute's worth each).
    # Each request: 0.3 GPU-s. At most 1.0 in flight, 1.1 a minute.
    core = AdmissionController(session_policy(max_inflight_gpu_seconds=1.0, gpu_seconds_per_minute=1.1),
                               clock=clock)
    agent = [core.decide(facts(4000, 200, api_key="ka", header_class="batch", session_id="s1")) for _ in range(4)]
    assert [d.kind for d in agent] == [ACCEPT] * 3 + [REJECT]
    core.apply(session_policy(max_inflight_gpu_seconds=1.0, gpu_seconds_per_minute=1.1, max_sessions=50_000))
    assert core.decide(facts(4000, 200, api_key="ka", header_class="batch", session_id="s1")).reason \
        == "session_inflight_budget"
    for d in agent[:3]:
        core.finish(d.ticket, Outcome.OK)  # released against the session that holds them
    assert core.sessions.sessions[("a", "s1")].inflight_gpu_s == 0.0
    core.apply(session_policy(gpu_seconds_per_minute=1.1))  # no in-flight budget now; 0.9 of the minute's 1.1 spent
    assert core.decide(facts(4000, 200, api_key="ka", header_class="batch", session_id="s1")).reason \
        == "session_gpu_seconds_per_minute"


def test_a_reload_adding_a_session_rate_refunds_no_gpu_seconds_the_session_never_paid(clock):
    # Admitted with no per-minute session budget (nothing taken), then a reload added one: the request's withdrawal
    # (413 after the decision) gave its 0.3 GPU-s back into the session's new bucket, past what it had spent of it
    # (found by test_ratelimit_model).
    core = AdmissionController(session_policy(max_inflight_gpu_seconds=10.0), clock=clock)  # each: 0.3 GPU-s
    first = core.decide(facts(4000, 200, api_key="ka", header_class="batch", session_id="s1"))
    core.apply(session_policy(max_inflight_gpu_seconds=10.0, gpu_seconds_per_minute=0.6))
    second = core.decide(facts(4000, 200, api_key="ka", header_class="batch", session_id="s1"))
    assert first.kind == second.kind == ACCEPT
    bucket = core.sessions.sessions[("a", "s1")].bucket
    assert math.isclose(bucket.level, 0.3)
    core.withdraw(first.ticket)
    assert math.isclose(bucket.level, 0.3)  # it paid nothing of this bucket: nothing comes back
    core.withdraw(second.ticket)
    assert math.isclose(bucket.level, 0.6)


@pytest.mark.parametrize("status, refunded", [(400, True), (503, True), (200, False)])
def test_a_request_the_replica_refused_does_not_spend_its_sessions_gpu_seconds(clock, status, refunded):
    # A session's request of ~55 GPU-seconds refused by the replica (a 400: max_tokens past its context) took them
    # from the session's 60 a minute, and the same request sent again a second later was refused 429 for 49 s
    # (a hostile-client audit). The tenant's token bucket was already refunded for such answers.
    core = AdmissionController(session_policy(gpu_seconds_per_minute=0.5), clock=clock)  # each: 0.3 GPU-s
    d = core.decide(facts(4000, 200, api_key="ka", header_class="batch", session_id="s1"))
    assert d.kind == ACCEPT
    core.finish(d.ticket, Outcome.OK if status < 500 else Outcome.UPSTREAM_ERROR, status)
    core.report(d.ticket.id, Completion(Outcome.OK if status < 500 else Outcome.UPSTREAM_ERROR, status, 0.01, 0.01))
    clock.advance(1.0)
    again = core.decide(facts(4000, 200, api_key="ka", header_class="batch", session_id="s1"))
    assert again.kind == (ACCEPT if refunded else REJECT)


def test_a_tenant_limits_retry_after_waits_for_the_sessions_bucket_too(clock):
    # The tenant's request is back in 1 s, the session's GPU-seconds in 12+: the 429 said 1 s, and a client that
    # honoured it was refused again by its session's budget (found by test_ratelimit_model).
    core = AdmissionController(make_policy(
        classes={"batch": {"max_concurrency": 100}}, default_class="batch", shed={},
        tenants=[{"name": "a", "api_keys": ["ka"], "requests_per_minute": 60, "burst_s": 1}],
        sessions={"gpu_seconds_per_minute": 0.5},
        models={"llama": {"cluster": "x", "cost": {"prefill_s_per_1k_tokens": 0.1, "decode_s_per_token": 0.001}}}),
        clock=clock)  # each request: 0.3 GPU-s
    assert core.decide(facts(4000, 200, api_key="ka", header_class="batch", session_id="s1")).kind == ACCEPT
    d = core.decide(facts(4000, 200, api_key="ka", header_class="batch", session_id="s1"))
    assert d.reason == "tenant_requests_per_minute" and d.retry_after >= 12
    clock.advance(d.retry_after)
    assert core.decide(facts(4000, 200, api_key="ka", header_class="batch", session_id="s1")).kind == ACCEPT

def test_session_table_is_bounded():
    core = AdmissionController(make_policy(sessions={"max_inflight_gpu_seconds": 1.0, "max_sessions": 10},
                                           classes={"batch": {"max_concurrency": 100}}, default_class="batch",
                                           tenants=[], shed={}))
    for i in range(100):
        d = core.decide(RequestFacts(model="llama", header_class="batch", session_id=f"s{i}"))
        core.finish(d.ticket, Outcome.OK)
    assert len(core.sessions.sessions) <= 10


def test_session_table_stays_bounded_when_sessions_run_requests_side_by_side():
    # An agent's parallel calls: their costs summed into the session's in-flight GPU-seconds and taken out again
    # left float dust (0.1 + 0.2 - 0.1 - 0.2 = 3e-17), so an idle session read as running, was never forgotten and
    # the table grew with every such session (a churn soak: 10744 sessions held under max_sessions 100).
    core = AdmissionController(make_policy(sessions={"max_inflight_gpu_seconds": 100.0, "max_sessions": 10},
                                           classes={"batch": {"max_concurrency": 100}}, default_class="batch",
                                           tenants=[], shed={}))
    rng = random.Random(1)
    for i in range(200):
        tickets = [core.decide(facts(rng.randrange(100, 4000), rng.randrange(1, 500), header_class="batch",
                                     session_id=f"s{i}")).ticket for _ in range(3)]
        for t in tickets:
            core.finish(t, Outcome.OK)
    assert len(core.sessions.sessions) <= 10
    assert all(s.inflight_gpu_s == 0.0 for s in core.sessions.sessions.values())



def test_a_busy_session_does_not_keep_the_idle_ones_behind_it():
    # Forgetting stopped at the least recently seen session when it was running: every idle one behind it stayed,
    # and the table passed max_sessions by more than the sessions running (found by test_ratelimit_model).
    def policy(max_sessions):
        return make_policy(sessions={"max_inflight_gpu_seconds": 100.0, "max_sessions": max_sessions},
                           classes={"batch": {"max_concurrency": 100}}, default_class="batch", tenants=[], shed={})

    core = AdmissionController(policy(3))
    busy = core.decide(RequestFacts(model="llama", header_class="batch", session_id="busy"))
    for name in ("idle1", "idle2"):
        core.finish(core.decide(RequestFacts(model="llama", header_class="batch", session_id=name)).ticket)
    core.apply(policy(2))  # a lowered bound holds at once: the oldest idle session goes
    assert [key[1] for key in core.sessions.sessions] == ["busy", "idle2"]
    core.decide(RequestFacts(model="llama", header_class="batch", session_id="new"))
    assert [key[1] for key in core.sessions.sessions] == ["busy", "new"]
    core.finish(busy.ticket)

def test_a_new_session_passes_over_no_busy_session_to_find_one_to_forget():
    # Found by bench/cardinality.py: with the table full, each new session id looked for an idle session to forget
    # from the least recently seen one on, past every session running there: O(sessions running) per arrival of a
    # fresh id (a client sets x-session-id). The idle ones are kept in their own order now.
    from collections import OrderedDict

    class Visits(OrderedDict):
        visits = 0

        def items(self):
            for item in super().items():
                self.visits += 1
                yield item

        def values(self):
            for value in super().values():
                self.visits += 1
                yield value

    core = AdmissionController(make_policy(sessions={"max_inflight_gpu_seconds": 100.0, "max_sessions": 10},
                                           classes={"batch": {"max_concurrency": 1000}}, default_class="batch",
                                           tenants=[], shed={}))
    running = [core.decide(RequestFacts(model="llama", header_class="batch", session_id=f"busy{i}")).ticket
               for i in range(500)]
    core.sessions.sessions = table = Visits(core.sessions.sessions)
    for i in range(200):
        core.finish(core.decide(RequestFacts(model="llama", header_class="batch", session_id=f"s{i}")).ticket)
    assert len(table) == 501 and sum(key[1].startswith("s") for key in table) == 1  # the last one, idle
    assert table.visits == 0  # each arrival passed over the 500 running: 100,000
    for t in running:
        core.finish(t)
    core.finish(core.decide(RequestFacts(model="llama", header_class="batch", session_id="last")).ticket)
    assert [key[1] for key in table] == [f"busy{i}" for i in range(491, 500)] + ["last"]  # those that ended last


def test_check_warns_when_tenant_limits_sum_past_the_fleet():
    p = load_policy({"classes": {"a": {"max_concurrency": 1}}, "models": {"m": {"cluster": "c"}},
                     "fleet": {"tokens_per_minute": 1000},
                     "tenants": [{"name": "t1", "tokens_per_minute": 800}, {"name": "t2", "tokens_per_minute": 800}]})
    (w,) = policy_warnings(p)
    assert "sum to 1600" in w and "fleet.tokens_per_minute = 1000" in w


def test_a_configured_tokenizer_gives_exact_prompt_counts(tmp_path):
    from tokenizers import Tokenizer

    path = whitespace_tokenizer(tmp_path)
    tok = Tokenizer.from_file(path)
    doc = {"messages": [{"role": "user", "content": "the queue is short"}]}
    exact = CostModel(CostSpec(tokenizer=path)).prompt_tokens(doc)
    assert exact == MESSAGE_OVERHEAD_TOKENS + len(tok.encode("the queue is short", add_special_tokens=False).ids)
    # the tokenizer reads the same texts as the fast estimate: a Responses body's instructions and items too
    items = {"instructions": "the queue", "input": [{"type": "function_call_output", "output": "is short"}]}
    expected = len(tok.encode("the queue\nis short", add_special_tokens=False).ids)
    assert CostModel(CostSpec(tokenizer=path)).prompt_tokens(items) == MESSAGE_OVERHEAD_TOKENS + expected
    missing = CostModel(CostSpec(tokenizer=str(tmp_path / "absent.json"))).prompt_tokens(doc)
    assert missing == CostModel(CostSpec()).prompt_tokens(doc)  # falls back to the fast estimate


def whitespace_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the queue in front of the model is short today"] * 50,
                            trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]"]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return str(path)


class Spy:
    """Wraps a tokenizer and records how many characters each encode() was given."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def encode(self, text, **kwargs):
        self.seen.append(len(text))
        return self.inner.encode(text, **kwargs)


def test_the_tokenizer_counts_a_bounded_head_of_a_huge_prompt_and_the_estimate_stays_large(tmp_path):
    """Before: the whole prompt went to the tokenizer, on the event loop: 2-4 s for 4 MB (bench in
    docs/benchmarks.md), every other request's decision waiting behind it."""
    model = CostModel(CostSpec(tokenizer=whitespace_tokenizer(tmp_path)))
    model._tokenizer = spy = Spy(model._tokenizer)
    sentence = "the queue, in front; of the model. "  # denser than the fast estimate's 4 characters a token
    small = {"messages": [{"role": "user", "content": sentence * 10}]}
    exact = model.prompt_tokens(small)  # short prompts are still counted exactly
    assert exact == MESSAGE_OVERHEAD_TOKENS + len(spy.inner.encode(sentence * 10, add_special_tokens=False).ids)
    huge = {"messages": [{"role": "user", "content": sentence * (4_000_000 // len(sentence))}] * 3}
    got = model.prompt_tokens(huge)
    assert max(spy.seen) <= TOKENIZE_MAX_CHARS
    per_char = (exact - MESSAGE_OVERHEAD_TOKENS) / len(sentence * 10)
    chars = 3 * 4_000_000
    assert per_char > 1 / 4 and got == pytest.approx(per_char * chars, rel=0.01)  # the head's rate carries over
    # A cheap head does not make a dense tail cheap: the tail counts at least at the fast estimate's rate.
    tricky = {"messages": [{"role": "user", "content": "the " * 10_000}, {"role": "user", "content": "x" * 400_000}]}
    assert model.prompt_tokens(tricky) >= 400_000 / 4


def test_a_cheap_ascii_head_does_not_make_a_non_ascii_tail_cheaper_than_the_fast_estimate(tmp_path):
    # The tail past the tokenized head was counted by characters at the ASCII head's rate (~4 characters a token):
    # a 1.2 MB CJK tail (about a token a character) came out at a third of what the fast estimate, which counts
    # its UTF-8 bytes, gives without any tokenizer.
    model = CostModel(CostSpec(tokenizer=whitespace_tokenizer(tmp_path)))
    cjk = "你好世界" * 100_000
    doc = {"messages": [{"role": "user", "content": "the " * 10_000}, {"role": "user", "content": cjk}]}
    assert model.prompt_tokens(doc) >= CostModel(CostSpec()).prompt_tokens({"prompt": cjk})


def test_a_tokenizer_that_cannot_be_loaded_is_said_once_in_the_log(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="extproc.cost"):
        model = CostModel(CostSpec(tokenizer=str(tmp_path / "missing.json")))
    assert model.prompt_tokens({"messages": [{"role": "user", "content": "hello there"}]}) > 0
    assert "cannot be loaded" in caplog.text and "missing.json" in caplog.text


def test_output_that_cannot_end_early_is_expected_in_full_and_not_learned_from():
    m = CostModel(SPEC)
    m.output_ratio = 0.2
    assert m.estimate(100, 500).expected_output == pytest.approx(100)
    forced = m.estimate(100, 500, sequences=2, min_output=None)       # ignore_eos: runs to its cap
    assert forced.expected_output == 1000 and forced.forced == 1000
    assert m.estimate(100, 500, min_output=300).expected_output == 300  # min_tokens: at least that many
    assert m.estimate(100, 500, min_output=20).expected_output == pytest.approx(100)
    assert m.estimate(100, 50, min_output=300).expected_output == 50   # (vLLM refuses that one anyway)
    m.learn(forced, 100, 1000, None)
    assert m.output_ratio == 0.2 and m.samples == 1
    m.learn(m.estimate(100, 500), 100, 500, None)
    assert m.output_ratio > 0.2


def test_output_that_cannot_end_early_without_a_cap_runs_to_vllms_own_default_not_the_policys_assumption():
    # Without max_tokens vLLM caps output at the rest of the context; default_max_tokens only assumes where answers
    # end. An ignore_eos chat request with no max_tokens ran 7,992 tokens and was expected at 512; a min_tokens of
    # 4,000 likewise at 512.
    m = CostModel(CostSpec(default_max_tokens=512, max_context_tokens=8192))
    forced = m.estimate(200, None, min_output=None)
    assert forced.expected_output == forced.max_tokens == forced.forced == 8192 - 200
    floor = m.estimate(200, None, min_output=4000)
    assert floor.expected_output == floor.max_tokens == 4000
    assert CostModel(CostSpec(default_max_tokens=512)).estimate(200, None, min_output=4000).expected_output == 4000
    assert m.estimate(200, None, min_output=20).max_tokens == 512  # a floor below the assumption changes nothing
    assert CostModel(CostSpec(default_max_tokens=512)).estimate(200, None, min_output=None).max_tokens == 512


def test_a_truncated_prompt_is_costed_at_what_the_replica_keeps():
    m = CostModel(CostSpec(max_context_tokens=2048))
    assert m.truncated(10_000, 50) == 50
    assert m.truncated(10_000, 50, prompts=2) == 100       # each prompt of a list keeps its own 50
    assert m.truncated(30, 50) == 30                        # shorter than the cap: all of it
    assert m.truncated(10_000, -1) == 2048                  # -1: the context
    assert CostModel(CostSpec()).truncated(10_000, -1) == 10_000  # ... unknown without max_context_tokens
    assert m.truncated(10_000, None) == 10_000


def test_the_usage_sample_reads_a_deterministic_share_and_every_answer_a_token_bucket_refunds(clock):
    from extproc.policy.outcomes import LEARN, REFUND, UsageSample
    core = AdmissionController(make_policy(learn_sample=0.25, tenants=[
        {"name": "metered", "api_keys": ["m"], "tokens_per_minute": 10_000},
        {"name": "plain", "api_keys": ["p"]}], shed={}), clock=clock)
    sample = UsageSample()
    picks = [sample.pick(core, "p") for _ in range(8)]
    assert picks == [None, None, None, LEARN] * 2  # every 4th request, refused ones counting too
    assert [sample.pick(core, "m") for _ in range(4)] == [REFUND, REFUND, REFUND, LEARN]


def test_a_reload_adding_a_token_limit_refunds_no_tokens_the_running_requests_never_paid(clock):
    # Admitted under a requests-only limit (no tokens taken), then a reload added tokens_per_minute: the request's
    # settlement from its usage gave back, into the new bucket, the 600 tokens of its estimate it never paid, and
    # the tenant got past its new limit (found by test_ratelimit_model).
    spec = {"name": "acme", "api_keys": ["k"], "requests_per_minute": 600}
    core = AdmissionController(make_policy(tenants=[spec], shed={}), clock=clock)
    d = core.decide(RequestFacts(api_key="k", model="llama", max_tokens=500, header_class="batch",
                                 doc={"prompt": "x" * 400}))
    assert d.kind == ACCEPT
    core.apply(make_policy(tenants=[{**spec, "tokens_per_minute": 600, "burst_s": 60}], shed={}))
    spent = core.decide(RequestFacts(api_key="k", model="llama", max_tokens=500, header_class="batch",
                                     doc={"prompt": "x" * 400}))
    assert spent.kind == ACCEPT and dict(spent.headers)["x-ratelimit-remaining-tokens"] == "0"
    core.usage(d.ticket, 0, 0)
    core.finish(d.ticket, Outcome.OK)
    core.report(d.ticket.id, Completion(Outcome.OK, 200, 0.1, 1.0))
    assert core.tenant_limits["acme"].tokens.level == 0.0


def test_an_answer_is_expected_no_longer_than_answers_run_by_themselves():
    # Found by a long-context audit: one output ratio per model, learned mostly from chat (about half its cap),
    # expected a summary asking 32,768 tokens (14.7K after the context's clamp) to write 7.4K where every answer
    # ended near 150.
    m = CostModel(CostSpec(decode_s_per_token=0.01))
    chat = m.estimate(500, 300)
    for i in range(128):
        m.learn(chat, 500, 100 + i % 100, None)  # answers of 100-199 tokens, under their cap of 300
    assert m.natural_ceiling == 199
    assert m.estimate(500, 300).expected_output == pytest.approx(300 * m.output_ratio)  # the ratio, as before
    huge = m.estimate(500, 14_700)
    assert huge.expected_output == m.natural_ceiling and huge.gpu_seconds < m.estimate(500, 1_000).gpu_seconds * 1.1
    assert m.estimate(500, 14_700, sequences=4).expected_output == 4 * m.natural_ceiling
    capped = m.estimate(500, 100)
    for _ in range(100):
        m.learn(capped, 500, 100, None)  # answers that ran to their cap say nothing of where answers end
    assert m.natural_ceiling == 199
    for i in range(CostModel.NATURAL_SAMPLES - 3):
        m.learn(chat, 500, 150, None)
    m.learn(chat, 500, 290, None)  # one long answer among 256: the longest bounds what the next may write
    assert m.natural_ceiling == 290


def test_forced_output_is_expected_in_full_whatever_the_natural_length():
    m = CostModel(CostSpec(decode_s_per_token=0.01))
    chat = m.estimate(500, 300)
    for _ in range(64):
        m.learn(chat, 500, 20, None)
    assert m.estimate(500, 4_000, min_output=None).expected_output == 4_000  # ignore_eos runs to its cap
