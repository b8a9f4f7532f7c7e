"""Every number the demo's report prints, against a reference written from docs/demo.md ("What is reported").

Seeded random scenarios (phases calm, in between and overloaded, some with no arrival, report windows of one or
several phases, one SLO kind or several tenants) and random records of five modes, in the shape the load generator
and the what-if write (records-*.jsonl): every outcome a record can have, ties, latencies exactly at the SLO,
requests that start in one window and end in the next, starts exactly on phase and rolling-window boundaries, and
modes that refuse everything. The reference is plain loops and numpy's nearest-rank percentile
(`method="inverted_cdf"`, the rule the docs state); it is compared with `results.scenario_stats`, with the tables
and target lines `print_tables` prints, and each target's verdict with the numbers it prints.
"""

from __future__ import annotations

import contextlib
import io
import math
import random
import re

import numpy as np
import pytest
import yaml

from extproc.tools.demo import print_tables, scenario_modes
from extproc.tools.demo.baselines import admitter_for
from extproc.tools.demo.modes import MODES
from extproc.tools.demo.results import scenario_stats
from extproc.tools.demo.runner import ModeResult
from extproc.tools.demo.scenario import Scenario
from extproc.tools.demo.whatif import what_if
from extproc.tools.loadgen import RequestRecord

SLO_S, TIMEOUT_S = 2.0, 60.0
BIG, SMALL = "llama-70b", "llama-8b"
KEYS = "abcde"
NAN = float("nan")


# ---- the reference, from docs/demo.md ("What is reported")

def pct(values: list[float], q: int) -> float:
    """Nearest rank: numpy's inverted CDF, checked against the rank ceil(q% of n) in integers."""
    if not values:
        return NAN
    got = float(np.percentile(np.array(values), q, method="inverted_cdf"))
    assert got == sorted(values)[max(1, -(-q * len(values) // 100)) - 1]
    return got


def is_ok(r: RequestRecord) -> bool:
    return r.status == 200 and r.error is None


def is_degraded(r: RequestRecord) -> bool:  # answered by another model, or degraded by the policy on the same one
    return r.degraded_by_policy or (r.model is not None and r.model != r.asked_model)


def latency(r: RequestRecord) -> float | None:
    """Completed, or timed out (at the timeout); refusals, HTTP errors, failures and aborts are no latency."""
    if r.status >= 400:
        return None
    if r.error == "timeout":
        return TIMEOUT_S
    return r.latency if is_ok(r) else None


def first_token(r: RequestRecord) -> float | None:
    if r.status >= 400:
        return None
    if r.ttft is not None:
        return r.ttft
    return TIMEOUT_S if r.error == "timeout" else None


def failed(r: RequestRecord) -> bool:
    if r.status >= 400:
        return r.status not in (429, 503)
    return not is_ok(r) and r.error not in ("timeout", "abort", "client_overload")


def outcome(r: RequestRecord, extproc: bool) -> str:
    if is_ok(r):
        return "ok"
    if r.status == 429 or (r.status == 503 and not extproc):
        return "rejected"
    if r.status == 503:
        return "shed"
    return "timeout" if r.error == "timeout" else "error"


def worst_window(slo: list[RequestRecord], t0: float, t1: float, onsets: list[float]) -> tuple[float, set]:
    """The worst p99 over every 10 s window inside [t0, t1) (1 s steps; one window when shorter) and the first 5 s
    of each overload starting in it; and the starts of the windows that give it."""
    spans = [(o, min(o + 5.0, t1)) for o in onsets]
    spans += [(t0 + k, min(t0 + k + 10.0, t1)) for k in range(max(1, math.ceil(t1 - t0 - 10.0) + 1))]
    found = []
    for a, b in spans:
        lat = [x for r in slo if a <= r.start < b for x in [latency(r)] if x is not None]
        if lat:
            found.append((pct(lat, 99), a))
    if not found:
        return NAN, set()
    worst = max(p for p, _ in found)
    return worst, {a for p, a in found if p == worst}


def fairness(started: list[RequestRecord], kinds: tuple[str, ...]) -> float:
    if len(kinds) < 2:
        return NAN
    asked, served = {}, {}
    for k in kinds:
        mine = [r for r in started if r.kind == k]
        answered = [r.output_tokens for r in mine if is_ok(r)]
        mean = sum(answered) / len(answered) if answered else 0.0
        asked[k] = sum(r.prompt_tokens + (r.output_tokens if is_ok(r) else mean) for r in mine)
        served[k] = sum(r.prompt_tokens + r.output_tokens for r in mine
                        if is_ok(r) and not is_degraded(r) and r.latency <= SLO_S)
    left, due = sum(served.values()), {}
    order = sorted(kinds, key=lambda k: asked[k])
    for i, k in enumerate(order):  # water-filling, smallest demand first
        due[k] = min(asked[k], left / (len(order) - i))
        left -= due[k]
    xs = [served[k] / due[k] for k in kinds if due[k] > 0]
    if not xs or not any(xs):
        return 1.0
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


def window(records: list[RequestRecord], t0: float, t1: float, group: tuple[str, ...], extproc: bool,
           onsets: list[float]) -> dict:
    span = t1 - t0
    started = [r for r in records if t0 <= r.start < t1]
    slo = [r for r in started if r.kind in group]
    lats = [x for r in slo for x in [latency(r)] if x is not None]
    ttfts = [x for r in slo for x in [first_token(r)] if x is not None]
    out = {"p50": pct(lats, 50), "p95": pct(lats, 95), "p99": pct(lats, 99), "ttft_p99": pct(ttfts, 99)}
    good = [r for r in slo if is_ok(r) and r.latency <= SLO_S]
    out["goodput"] = sum(1 for r in good if not is_degraded(r)) / span
    out["goodput_degraded"] = sum(1 for r in good if is_degraded(r)) / span
    tokens = useful = useful_degraded = 0
    for r in records:  # tokens when they end
        if is_ok(r) and t0 <= r.start + r.latency < t1:
            tokens += r.output_tokens
            if r.kind not in group or r.latency <= SLO_S:
                if is_degraded(r):
                    useful_degraded += r.output_tokens
                else:
                    useful += r.output_tokens
    out.update(tokens_per_s=tokens / span, useful_tokens_per_s=useful / span,
               degraded_tokens_per_s=useful_degraded / span, requests=len(started))
    outcomes, by_class = {}, {}
    for cls in {r.kind for r in started}:
        mine = [r for r in started if r.kind == cls]
        n = len(mine)
        outcomes[cls] = {k: 100.0 * sum(1 for r in mine if outcome(r, extproc) == k) / n
                         for k in ("rejected", "shed", "timeout", "error")}
        outcomes[cls]["degraded"] = 100.0 * sum(1 for r in mine if is_ok(r) and is_degraded(r)) / n
        done = [r for r in mine if is_ok(r) and (cls not in group or r.latency <= SLO_S)]
        by_class[cls] = {"full": sum(1 for r in done if not is_degraded(r)) / span,
                         "degraded": sum(1 for r in done if is_degraded(r)) / span}
    out.update(outcomes=outcomes, goodput_by_class=by_class)
    out["p99_worst_window"], out["worst_at"] = worst_window(slo, t0, t1, onsets)
    out["refused"] = sum(1 for r in started if r.status in (429, 503))
    out["failed"] = sum(1 for r in started if failed(r))
    out["degraded"] = sum(1 for r in started if is_ok(r) and is_degraded(r))
    degraded_at = [r.start + r.queue_wait for r in slo if is_ok(r) and is_degraded(r)]  # decided after its wait
    held_at = [r.start for r in started if r.kind not in group and (r.status in (429, 503) or r.queued)]
    out["first_degraded_at"] = min(degraded_at) if degraded_at else None
    out["first_other_held_at"] = min(held_at) if held_at else None
    out["fairness_index"] = fairness(started, group)
    out["others"] = len(started) - len(slo)
    out["started_per_s"] = len(started) / span
    return out


def phase_spans(doc: dict) -> dict[str, tuple[float, float, float]]:
    """Phase name -> (start, end, load as a multiple of capacity, its weights counted)."""
    kinds = doc["workload"]["kinds"]
    total = sum(k["weight"] for k in kinds)
    out, t = {}, 0.0
    for p in doc["phases"]:
        factors = p.get("weights", {})
        load = p["rate"] * sum(k["weight"] * factors.get(k["name"], 1.0) for k in kinds) / total
        out[p["name"]] = (t, t + p["duration_s"], load)
        t += p["duration_s"]
    return out


def reference(doc: dict, records: dict[str, list[RequestRecord]]) -> tuple[dict, dict, dict]:
    """(mode -> window name -> numbers, report windows, calm phases) for the scenario `doc`."""
    phases = phase_spans(doc)
    if doc.get("windows"):
        report = {name: (phases[ps[0]][0], phases[ps[-1]][1]) for name, ps in doc["windows"].items()}
    else:  # the phase of the highest load (the first of equals)
        top = max(phases.values(), key=lambda p: p[2])
        report = {"spike": (top[0], top[1])}
    calm = {f"phase {n}": (a, b) for n, (a, b, load) in phases.items() if load <= 0.6}
    onsets = [a for a, _, load in phases.values() if load > 1.0]
    group = tuple(doc["slo"].get("kinds") or [doc["slo"]["class"]])
    end = max(b for _, b, _ in phases.values())
    out = {}
    for m, recs in records.items():  # overall: every request, those started after the last phase too
        run = (0.0, max([end] + [r.start + 1e-12 for r in recs]))
        out[m] = {name: window(recs, a, b, group, m in "cde", [o for o in onsets if a <= o < b])
                  for name, (a, b) in {**report, **calm, "overall": run}.items()}
    spikes = [name for name, (a, b) in report.items() if any(a <= o < b for o in onsets)]
    return out, {name: report[name] for name in spikes}, calm


def expected_targets(ref: dict, report: list[str], spikes: list[str], calm: list[str], capacity: float) -> list[tuple]:
    """(name, value, bound, reached, note) of each target, in the order the report prints them."""
    out = []
    d, a, b = ref.get("d"), ref.get("a"), ref.get("b")

    def calm_targets(mode, key):
        for w in calm:
            s = mode[w]
            n = s["refused"] + s["degraded"] + s["failed"]
            notes = []
            if n:
                notes.append(f"started {s['started_per_s'] / capacity:.2f}x capacity")
            if n and a is not None and not math.isnan(a[w]["p99_worst_window"]):
                over = "over" if a[w]["p99_worst_window"] > SLO_S else "within"
                notes.append(f"no control there: p99 {a[w]['p99']:.2f} s, worst 10 s window "
                             f"{a[w]['p99_worst_window']:.2f} s ({over} the SLO)")
            out.append((f"{key}: {w}: requests refused, degraded or failed (== 0)", n, 0, n == 0, "; ".join(notes)))

    if d is not None:
        for w in spikes:
            s = d[w]
            out.append((f"d: {w}: interactive p99, worst 10 s window and first 5 s (<= SLO)", s["p99_worst_window"],
                        SLO_S, s["p99_worst_window"] <= SLO_S, ""))
            for key, base in (("b", b), ("a", a)):
                if base is not None:
                    out.append((f"d vs {key}: {w}: full-model interactive goodput, req/s (>= {key}'s)", s["goodput"],
                                base[w]["goodput"], s["goodput"] >= base[w]["goodput"], ""))
            if a is not None:
                bound = 0.96 * a[w]["useful_tokens_per_s"]
                out.append((f"d vs a: {w}: full-model useful output tokens/s (>= 0.96 x a's)",
                            s["useful_tokens_per_s"], bound, s["useful_tokens_per_s"] >= bound, ""))
            if s["others"]:
                held, degraded = s["first_other_held_at"], s["first_degraded_at"]
                name = f"d: {w}: first batch refused/queued before the first interactive degrade, s"
                if degraded is None:  # no degrade: nothing to check
                    out.append((name, NAN if held is None else held, NAN, None, "interactive was never degraded"))
                else:
                    out.append((name, NAN if held is None else held, degraded, held is not None and held <= degraded,
                                ""))
        calm_targets(d, "d")
    e = ref.get("e")
    if e is not None:
        for w in report:
            out.append((f"e: interactive p99 ({w}), s (<= SLO)", e[w]["p99"], SLO_S, e[w]["p99"] <= SLO_S, ""))
            static = [k for k in "cd" if k in ref]
            if static:
                best = max(ref[k][w]["goodput"] for k in static)
                out.append((f"e vs best static ({'/'.join(static)}): full-model interactive goodput ({w}), req/s",
                            e[w]["goodput"], best, e[w]["goodput"] >= best, ""))
            if b is not None:
                out.append((f"e vs b: full-model interactive goodput ({w}), req/s", e[w]["goodput"],
                            b[w]["goodput"], e[w]["goodput"] >= b[w]["goodput"], ""))
        calm_targets(e, "e")
    return out


# ---- random scenarios and records

def random_scenario(rng: random.Random) -> dict:
    tenants = rng.random() < 0.35
    names = ["tenant-a", "tenant-b", "tenant-c", "batch"] if tenants else ["interactive", "batch"]
    kinds = [{"name": n, "weight": rng.choice([0.2, 0.3, 0.5, 0.7]), "model": BIG, "max_tokens": 256,
              "prompt_tokens": {"min": 100, "max": 3000}} for n in names]
    phases = []
    for i in range(rng.randint(1, 5)):
        p = {"name": f"p{i}", "duration_s": rng.choice([1.0, 4.0, 5.0, 10.0, 11.0, 17.0, 25.0, 12.5]),
             "rate": rng.choice([0.0, 0.3, 0.6, 0.6, 0.8, 1.0, 1.7, 3.0])}
        if rng.random() < 0.2:
            p["weights"] = {rng.choice(names): rng.choice([0.0, 2.0, 5.0])}
        phases.append(p)
    doc = {"name": "generated", "description": "generated", "seed": rng.randrange(1000),
           "pools": {"vllm_llama70b": {"profile": "h100-llama70b-awq", "replicas": 2, "model_names": [BIG]},
                     "vllm_llama8b": {"profile": "h100-llama8b", "replicas": 1, "model_names": [SMALL]}},
           "phases": phases, "workload": {"kinds": kinds},
           "slo": {"class": "interactive", "p95_s": SLO_S, **({"kinds": names[:3]} if tenants else {})},
           "client_timeout_s": TIMEOUT_S, "capacity": rng.choice([8.0, 8.0, 30.0])}
    if len(phases) > 1 and rng.random() < 0.5:  # report windows of consecutive phases
        cut = rng.randint(1, len(phases) - 1)
        doc["windows"] = {"first": [p["name"] for p in phases[:cut]], "second": [p["name"] for p in phases[cut:]]}
    return doc


# What happens to a request: (status, error, degraded by the policy, answered by the small model)
OUTCOMES = {
    "full": (200, None, False, False), "small": (200, None, False, True), "clamped": (200, None, True, False),
    "429": (429, "rate_limit_error", False, False), "503": (503, "service_unavailable", False, False),
    "404": (404, "NotFoundError", False, False), "500": (500, "api_error", False, False),
    "timeout": (0, "timeout", False, False), "stream_timeout": (200, "timeout", False, False),
    "degraded_timeout": (0, "timeout", True, True), "reset": (0, "ClientConnectorError", False, False),
    "cut": (200, "incomplete_stream", False, False), "abort": (0, "abort", False, False),
    "overload": (0, "client_overload", False, False),
}


def random_record(rng: random.Random, start: float, kind: str, mix: dict[str, float], scale: float,
                  slow: float) -> RequestRecord:
    what = rng.choices(list(mix), weights=list(mix.values()))[0]
    status, error, by_policy, small = OUTCOMES[what]
    if rng.random() < slow:  # a rare slow answer: over the SLO in a 10 s window, not always over the whole p99
        lat = rng.choice([3.0, 7.0, rng.uniform(2.0, 10.0)])
    elif rng.random() < 0.3:  # ties, and answers exactly at the SLO
        lat = rng.choice([0.25, 1.0, 2.0, 2.0])
    else:
        lat = rng.lognormvariate(math.log(scale), 0.6)
    if error == "timeout":
        lat = TIMEOUT_S if status == 0 else rng.uniform(TIMEOUT_S - 1, TIMEOUT_S)
    elif status in (429, 503, 404, 500) or error in ("ClientConnectorError",):
        lat = rng.uniform(0.0, 0.01)
    streamed = rng.random() < 0.7
    ttft = None
    if status == 200:
        ttft = min(lat, rng.uniform(0.0, 0.5)) if streamed else (lat if error is None else None)
    queued = rng.random() < 0.15
    r = RequestRecord(start, kind, "", status, latency=None if what == "overload" else lat, ttft=ttft,
                      output_tokens=rng.randint(1, 512) if status == 200 else 0,
                      prompt_tokens=rng.randint(100, 3000), error=error, asked_model=BIG,
                      model=(SMALL if small else BIG) if status == 200 or what == "degraded_timeout" else None,
                      queued=queued, queue_wait=rng.uniform(0.001, 0.3) if queued else 0.0,
                      degraded_by_policy=by_policy)
    return r


def random_records(rng: random.Random, doc: dict, mix: dict[str, float]) -> list[RequestRecord]:
    scale = rng.choice([0.3, 0.6, 1.0, 2.0])  # the mode's typical latency, s
    slow = rng.choice([0.0, 0.005, 0.01, 0.03])  # and its share of slow outliers
    kinds = [k["name"] for k in doc["workload"]["kinds"]]
    weights = [k["weight"] for k in doc["workload"]["kinds"]]
    out, t = [], 0.0
    for p in doc["phases"]:
        d = p["duration_s"]
        n = int(np.random.default_rng(rng.randrange(1 << 30)).poisson(p["rate"] * doc["capacity"] * d))
        starts = [t + rng.uniform(0, d) for _ in range(n)]
        if n:  # on the phase's start, on rolling-window edges, and ties
            starts += [t] + [t + k for k in range(1, int(d)) if rng.random() < 0.3] + [rng.choice(starts)] * 2
        w = [wt * p.get("weights", {}).get(k, 1.0) for k, wt in zip(kinds, weights)]
        for s in starts:
            out.append(random_record(rng, s, rng.choices(kinds, weights=w)[0] if any(w) else kinds[0], mix, scale, slow))
        t += d
    for _ in range(rng.randint(0, 3)):  # session calls and retries after the last phase ended
        out.append(random_record(rng, t + rng.uniform(0, 5), kinds[0], mix, scale, slow))
    return out


def mode_mixes(rng: random.Random) -> dict[str, dict[str, float]]:
    base = {k: rng.choice([0.0, 0.0, 0.005, 0.02, 0.1]) for k in OUTCOMES}
    mixes = {}
    for key in KEYS:
        mix = {**base, "full": rng.uniform(0.2, 2.0), "small": rng.choice([0.0, 0.3]),
               "429": rng.choice([0.0, 0.2]), "503": rng.choice([0.0, 0.2])}
        if rng.random() < 0.3:  # no timeout or failure: its p99 is its answers'
            mix = {k: mix[k] for k in ("full", "small", "clamped", "429", "503")}
        if rng.random() < 0.1:  # a mode that refuses everything
            mix = {"503": 1.0}
        mixes[key] = mix
    return mixes


# ---- comparisons

def same(got, want) -> bool:
    if isinstance(want, float) and math.isnan(want):
        return isinstance(got, float) and math.isnan(got)
    if want is None:
        return got is None
    return got == pytest.approx(want, rel=1e-9, abs=1e-9)


def check_stats(stats, ref) -> None:
    for m in ref:
        assert set(stats[m]) == set(ref[m]), m
        for w, want in ref[m].items():
            got = stats[m][w]
            for field, value in want.items():
                if field == "worst_at":
                    assert (got.p99_worst_window_at in value) if value else got.p99_worst_window_at is None, (m, w)
                elif field in ("outcomes", "goodput_by_class"):
                    have = getattr(got, field)
                    assert set(have) == set(value), (m, w, field)
                    for cls in value:
                        assert have[cls] == pytest.approx(value[cls]), (m, w, field, cls)
                else:
                    assert same(getattr(got, field), value), (m, w, field, getattr(got, field), value)


def close(text: str, want: float, digits: int) -> bool:
    """A printed number against the reference: the reference rounded to `digits`, within half a unit."""
    if math.isnan(want):
        return text in ("–", "nan")
    return abs(float(text.rstrip("×")) - want) <= 0.5 * 10 ** -digits + 1e-9


def ratio_ok(text: str, x: float, base: float) -> bool:
    if math.isnan(x) or math.isnan(base):
        return text == "–"
    if base == 0:
        return text == ("–" if x == 0 else "∞")
    return close(text, x / base, 2)


def tables_of(text: str) -> list[dict[str, list[str]]]:
    """The printed Markdown tables, each as mode key -> its row's cells."""
    out = []
    for block in text.split("\n\n"):
        rows = [line for line in block.splitlines() if line.startswith("| ") and ": " in line.split("|")[1]]
        if rows:
            out.append({row.split("|")[1].strip().split(":")[0]: [c.strip() for c in row.strip("|").split("|")][1:]
                        for row in rows})
    return out


def check_tables(printed: str, ref: dict, report: list[str], group: tuple[str, ...], degraded_all: dict) -> None:
    tables = tables_of(printed.split("\nTargets:")[0])
    assert len(tables) == 3 * len(report) + 1
    for i, w in enumerate(report):
        lat, thr, cls = tables[3 * i: 3 * i + 3]
        for m, cells in lat.items():
            s, o, a = ref[m][w], ref[m]["overall"], ref.get("a", {}).get(w)
            p = cells[0].split(" / ")
            assert all(close(x, s[q], 2) for x, q in zip(p, ("p50", "p95", "p99"))), (m, w, cells)
            assert close(cells[1], s["ttft_p99"], 2)
            assert cells[2] == "–" if a is None else ratio_ok(cells[2], s["p99"], a["p99"]), (m, w, cells)
            assert all(close(x, o[q], 2) for x, q in zip(cells[3].split(" / "), ("p50", "p95", "p99")))
            assert close(cells[4], o["ttft_p99"], 2)
        for m, cells in thr.items():
            s, o, a = ref[m][w], ref[m]["overall"], ref.get("a", {}).get(w)
            assert close(cells[0], s["goodput"], 2) and close(cells[2], s["goodput_degraded"], 2), (m, w, cells)
            assert close(cells[3], o["goodput"], 2) and close(cells[4], o["goodput_degraded"], 2), (m, w, cells)
            assert close(cells[5], s["useful_tokens_per_s"], 0) and close(cells[7], s["degraded_tokens_per_s"], 0)
            assert close(cells[8], s["tokens_per_s"], 0), (m, w, cells)
            for cell, x, key in ((cells[1], s["goodput"], "goodput"), (cells[6], s["useful_tokens_per_s"],
                                                                      "useful_tokens_per_s")):
                assert cell == "–" if a is None else ratio_ok(cell, x, a[key]), (m, w, cells)
        classes = sorted({c for m in ref for c in ref[m][w]["goodput_by_class"]})
        for m, cells in cls.items():
            by = ref[m][w]["goodput_by_class"]
            for c, cell in zip(classes, cells):
                full, deg = cell.split(" / ")
                assert close(full, by.get(c, {}).get("full", 0.0), 2) and close(deg, by.get(c, {}).get("degraded", 0.0), 2)
            assert len(cells) == len(classes) + (len(group) > 1)
            if len(group) > 1:
                assert close(cells[-1], ref[m][w]["fairness_index"], 2), (m, w, cells)
    classes = sorted({c for m in ref for c in ref[m]["overall"]["outcomes"]})
    for m, cells in tables[-1].items():
        for c, cell in zip(classes, cells):
            o = ref[m]["overall"]["outcomes"].get(c, {})
            values = cell.split(" / ")
            assert all(close(v, o.get(k, 0.0), 1) for v, k in zip(values, ("rejected", "shed", "timeout", "error",
                                                                          "degraded"))), (m, c, cell)
        assert close(cells[-1], degraded_all[m], 1)


def check_targets(printed: str, found, want: list[tuple]) -> None:
    assert [(t.name, t.reached, t.note) for t in found] == [(n, r, note) for n, _, _, r, note in want]
    for t, (_, value, bound, _, _) in zip(found, want):
        assert same(t.value, value) and same(t.bound, bound), (t.name, t.value, value, t.bound, bound)
    lines = [line.strip() for line in printed.split("\nTargets:")[1].splitlines() if line.strip()] if found else []
    assert len(lines) == len(want)
    for line, (name, _, _, reached, note) in zip(lines, want):
        verdict, rest = line.split(None, 1)
        if reached is None:
            assert verdict == "n/a" and rest == f"{name}: not applicable: {note}"
            continue
        assert verdict == ("reached" if reached else "MISSED") and rest.startswith(name + ": ")
        value, bound = re.match(r"(\S+) \(target (\S+)\)", rest[len(name) + 2:]).groups()
        if "nan" in (value, bound):  # no batch held back, or no interactive degrade, or nothing served
            continue
        v, b = float(value), float(bound)
        holds = v == b if "== 0" in name else v <= b if "<= SLO" in name or "before the first" in name else v >= b
        assert holds == reached, line  # the verdict follows from the numbers printed


def check_run(doc: dict, records: dict[str, list[RequestRecord]]) -> None:
    """scenario_stats, the printed tables and the printed targets of one run against the reference."""
    scenario = Scenario.from_dict(doc)
    keys = list(records)
    ref, spikes, calm = reference(doc, records)
    stats = {k: scenario_stats(records[k], scenario, MODES[k].stack_mode == "extproc") for k in keys}
    check_stats(stats, ref)
    results = [ModeResult(MODES[k], records[k], 0.0) for k in keys]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _, degraded_all, found = print_tables(results, scenario)
    for k in keys:
        assert degraded_all[k] == pytest.approx(
            100.0 * sum(1 for r in records[k] if is_ok(r) and is_degraded(r)) / max(1, len(records[k])))
    report = list(scenario.report_windows())
    check_tables(out.getvalue(), ref, report, tuple(doc["slo"].get("kinds") or [doc["slo"]["class"]]), degraded_all)
    check_targets(out.getvalue(), found, expected_targets(ref, report, list(spikes), list(calm), doc["capacity"]))


def run_one(seed: int) -> None:
    rng = random.Random(seed)
    doc = random_scenario(rng)
    mixes = mode_mixes(rng)
    keys = [k for k in KEYS if rng.random() < 0.8] or ["d"]
    check_run(doc, {k: random_records(rng, doc, mixes[k]) for k in keys})


@pytest.mark.parametrize("block", range(4))
def test_every_printed_number_and_verdict_matches_the_reference(block):
    for seed in range(block * 30, block * 30 + 30):
        run_one(seed)


@pytest.mark.parametrize("name", ["kv-agents", "noisy-neighbour"])
def test_the_what_ifs_own_records_match_the_reference(name):
    # Records as the what-if writes them: agent sessions calling and retrying past the last phase, tenants judged
    # together (their fairness index), phase weights, every mode's own outcomes.
    doc = yaml.safe_load(open(f"scenarios/{name}.yaml"))
    for p in doc["phases"]:
        p["duration_s"] = 10
    doc["capacity"] = Scenario.from_dict(doc).fleet_capacity()
    scenario = Scenario.from_dict(doc)
    records = {m.key: what_if(scenario, admitter_for(m), doc["capacity"]).records
               for m in scenario_modes(scenario, "a,b,c,d,e")}
    check_run(doc, records)
