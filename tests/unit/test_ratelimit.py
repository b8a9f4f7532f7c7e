"""TokenBucket and TenantLimits (per-tenant rate limits and their x-ratelimit-* headers)."""

import math

from extproc.policy.ratelimit import TenantLimits
from extproc.policy.schema import TenantSpec


def test_a_request_bucket_shallower_than_one_request_still_admits_at_its_rate():
    # requests_per_minute 30 with burst_s 1 (both valid) is a bucket of 0.5 requests: waiting for a whole request
    # in it was forever (wait inf), so the tenant was refused every request.
    limits = TenantLimits(TenantSpec(name="t", requests_per_minute=30, burst_s=1), 0.0)
    assert limits.check(1, 0.0) == (None, 0.0)
    limits.charge(1, 0.0)
    which, wait = limits.check(1, 0.0)
    assert which == "requests" and math.isfinite(wait) and wait > 0
    assert limits.check(1, 2.0) == (None, 0.0)  # 30 a minute: one every 2 s


def test_the_reset_header_is_never_zero_while_the_bucket_is_not_full():
    # 0.4 s from full was rounded to "0s" next to remaining 0: a client told the limit had reset retried at once.
    limits = TenantLimits(TenantSpec(name="t", requests_per_minute=60, burst_s=1), 0.0)
    limits.charge(1, 0.0)
    headers = dict(limits.headers(0.6))
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-reset-requests"] == "1s"
    assert dict(limits.headers(5.0))["x-ratelimit-reset-requests"] == "0s"  # full again


def test_a_refusal_waits_for_both_buckets_of_its_tenant():
    # Both buckets empty: a request is back in 1 s, its 100 tokens in 10 s. The refusal said the request limit's
    # 1 s, and a client that honoured Retry-After was refused again for 9 s more (found by test_ratelimit_model).
    limits = TenantLimits(TenantSpec(name="t", requests_per_minute=60, tokens_per_minute=600, burst_s=10), 0.0)
    limits.charge(100, 0.0)
    for _ in range(9):
        limits.charge(0, 0.0)
    which, wait = limits.check(100, 0.0)
    assert which == "tokens" and wait == 10.0
    assert limits.check(100, wait) == (None, 0.0)


def test_a_charge_refunded_leaves_the_token_bucket_where_it_was():
    # The tokens taken were rounded up from the bucket's float difference: 4095 taken from a level of -40.785...
    # read 4095.0000000000005, so 4096 were booked, and the refund (or a correction from usage) handed the tenant a
    # token it never paid, on ~1 charge in 150 (found by test_ratelimit_model's books).
    limits = TenantLimits(TenantSpec(name="t", tokens_per_minute=10_000, burst_s=60), 0.0)
    limits.tokens.level = -40.78546538336969
    taken = limits.charge(4095, 0.0)
    assert taken == 4095
    limits.refund(taken)
    assert math.isclose(limits.tokens.level, -40.78546538336969)
    # Clipped by the debt floor: what was taken, rounded down, never a fraction more.
    limits.tokens.level = -9_999.5
    assert limits.charge(100, 0.0) == 0
