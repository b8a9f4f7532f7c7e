"""Audit of scenarios/audit-zipf-tiers.yaml (24 Zipf-skewed interactive tenants in paid tiers, two of them with a
guaranteed share, and two batch tenants): each tenant's share of the 70B engine time against its weighted max-min
due, in the engine-model what-if.

`python bench/audit_zipf_tiers.py [--seeds 701,702,703] [--modes c,d,e] [--tenants t01,t05,...]`

Per window (whale, return), per mode, per interactive tenant:
- offered: requests started in the window; demand: offered x the tenant's mean engine time per full-model answer
  over the run (the engine model's own attribution, WhatIfResult.engine_work);
- served: engine time of its full-model answers to requests started in the window, as a share of what the class's
  full-model answers got (the capacity the class had, whatever the pool limit made of it);
- due: weighted max-min fair share of that capacity given the demands, with each tenant's `guaranteed_share` as a
  floor (x_i = min(d_i, max(g_i C, w_i L)), L chosen so the x_i sum to C);
- p99 of its full-model answers, goodput (full-model answers within the SLO, req/s), degraded and refused;
- for a tenant with a guaranteed share: how many of its degrades / refusals came while it held less than that share
  of what the class held on the 70B pool (in the pool limit's units, prompt + max_tokens), reconstructed from the
  records (a full-model answer holds its units from start + queue_wait to start + latency);
- Jain's index over served / due (tenants with a due above 0);
- what `extproc_class_fairness_index{class="interactive"}` read: the core's own, sampled every second, averaged
  over the window.
With --owed it also counts, per mode, how often PoolGate.owed said no to a flow holding nothing on the pool because
its share of the class's hold was smaller than the one request (the granularity of the owner's return).
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import tempfile
from collections import defaultdict

import yaml

from extproc.policy import pool as pool_mod
from extproc.policy.fairness import jain_index, max_min_shares
from extproc.tools.demo.scenario import Scenario
from extproc.tools.demo.whatif import what_if
from extproc.tools.stats import percentile
from fairness_index import IndexSampler  # bench/, this script's own folder

SCENARIO = "scenarios/audit-zipf-tiers.yaml"
SCENARIO_PATH = [SCENARIO]
MODES = {"c": "fifo", "d": "round_robin", "e": "fair"}


def hold_series(records, kinds):
    """Per kind: sorted (time, +units/-units) events of its full-model answers' holds on the pool."""
    ev = defaultdict(list)
    for r in records:
        if r.kind in kinds and r.ok and not r.degraded:
            u = r.prompt_tokens + 256
            ev[r.kind].append((r.start + r.queue_wait, u))
            ev[r.kind].append((r.start + r.latency, -u))
    out = {}
    for k, e in ev.items():
        e.sort()
        times, level, cur = [], [], 0.0
        for t, d in e:
            cur += d
            times.append(t)
            level.append(cur)
        out[k] = (times, level)
    return out


def held_at(series, kind, t):
    times, level = series.get(kind, ([], []))
    i = bisect.bisect_right(times, t) - 1
    return level[i] if i >= 0 else 0.0


def owed_one(orig):
    """Counterfactual (bench only, not the shipped rule): a fair class's flow holding nothing on the pool is owed
    one request even where its share of the class's hold is smaller than that request (as a class's min_share
    lets a class holding nothing run one request larger than its share)."""
    def owed(self, rank, flow, units, share, now):
        if orig(self, rank, flow, units, share, now):
            return True
        if share <= 0.0 or self._squeezed(rank, now) or self.held_by(rank, flow) > 0.0:
            return False
        if self.inflight - self.stuck + units > pool_mod.OWED_BOUND * self.limit:
            return False
        return self.held[rank] - 0.0 >= units
    return owed


def policy_variant(path: str, variant: str) -> str:
    if variant != "borrow":
        return path
    with open(path, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    doc["pools"]["vllm_llama70b"]["limit"]["borrow_lower"] = True
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(doc, f, sort_keys=False)
    return f.name


OWED_NO = defaultdict(int)  # (mode) -> times owed() refused a flow holding nothing because share x hold < units
OWED_ASKED = defaultdict(int)


def patch_owed(mode_key: str):
    orig = pool_mod.PoolGate.owed

    def owed(self, rank, flow, units, share, now):
        ok = orig(self, rank, flow, units, share, now)
        if rank == 0 and self.held_by(rank, flow) == 0.0 and share > 0.0:
            OWED_ASKED[mode_key] += 1
            cap = self.limit
            if not ok and units > share * min(self.held[rank] + units, cap) \
                    and self.inflight - self.stuck + units <= pool_mod.OWED_BOUND * self.limit \
                    and self.held[rank] >= units:
                OWED_NO[mode_key] += 1
        return ok

    pool_mod.PoolGate.owed = owed
    return orig


def run(seed: int, modes: str, show: list[str] | None, owed_check: bool, variant: str = "",
        summary: bool = False) -> dict:
    sc = dataclasses.replace(Scenario.load(SCENARIO_PATH[0]), seed=seed)
    capacity = sc.fleet_capacity()
    with open(sc.policies["e"], encoding="utf-8") as f:
        tenants = {t["name"]: t for t in yaml.safe_load(f)["tenants"]}
    inter = list(sc.slo_kinds)
    weight = {k: float(tenants[k].get("weight", 1.0)) for k in inter}
    floor = {k: float(tenants[k].get("guaranteed_share", 0.0)) for k in inter}
    out = {}
    if not summary:
        print(f"\n## seed {seed}: capacity {capacity:.2f} req/s")
    for key in modes:
        orig = pool_mod.PoolGate.owed
        if variant == "owed1":
            pool_mod.PoolGate.owed = owed_one(orig)
        if owed_check:
            patch_owed(f"{seed}{key}")
        try:
            admitter = IndexSampler(policy_variant(sc.policies[key], variant))
            res = what_if(sc, admitter, capacity)
        finally:
            pool_mod.PoolGate.owed = orig
        recs = res.records
        work = res.engine_work
        per_req = {}
        for k in inter + ["lc", "etl"]:
            full = [work.get(id(r), 0.0) for r in recs if r.kind == k and r.ok and not r.degraded]
            per_req[k] = sum(full) / len(full) if full else 0.0
        mean_all = sum(per_req[k] for k in inter) / len(inter)
        series = hold_series(recs, inter)
        for wname, (t0, t1) in sc.report_windows().items():
            span = t1 - t0
            started = [r for r in recs if t0 <= r.start < t1]
            offered = {k: sum(1 for r in started if r.kind == k) for k in inter}
            # every interactive tenant draws from the same request mix: one in-window engine time per request for all
            # (a tenant's own run-wide mean mixes calm and flood phases, where a request's share of a step differs)
            got = [work.get(id(r), 0.0) for r in started if r.kind in inter and r.ok and not r.degraded]
            per = sum(got) / len(got) if got else mean_all
            demand = {k: offered[k] * per for k in inter}
            served = {k: sum(work.get(id(r), 0.0) for r in started if r.kind == k and r.ok and not r.degraded)
                      for k in inter}
            cap = sum(served.values())
            due = max_min_shares(demand, weight, cap, floor)  # guaranteed shares as floors
            rows = {}
            for k in inter:
                mine = [r for r in started if r.kind == k]
                full = sorted(r.latency for r in mine if r.ok and not r.degraded)
                good = sum(1 for r in mine if r.ok and not r.degraded and r.latency <= sc.slo_p95_s)
                degraded = [r for r in mine if r.ok and r.degraded]
                refused = [r for r in mine if not r.ok]
                under = 0
                if floor[k] > 0:
                    for r in degraded + refused:
                        t = r.start + r.queue_wait
                        cls = sum(held_at(series, j, t) for j in inter)
                        if held_at(series, k, t) < floor[k] * cls:
                            under += 1
                rows[k] = dict(offered=offered[k], served=100 * served[k] / cap if cap else 0.0,
                               due=100 * due[k] / cap if cap else 0.0, asked=100 * demand[k] / cap if cap else 0.0,
                               p99=percentile(full, 99) if full else float("nan"), goodput=good / span,
                               degraded=len(degraded), refused=len(refused), under=under,
                               late=sum(1 for x in full if x > sc.slo_p95_s))
            ratios = [served[k] / due[k] for k in inter if due[k] > 0]
            jain = jain_index(ratios)
            # Tenants that asked for less than their weighted equal share: they should get everything they asked.
            small = [k for k in inter if due[k] >= demand[k] * 0.999]
            small_lost = sum(rows[k]["degraded"] + rows[k]["refused"] for k in small)
            small_off = sum(offered[k] for k in small)
            batch = {k: (sum(1 for r in started if r.kind == k and r.ok and not r.degraded),
                         sum(1 for r in started if r.kind == k)) for k in ("lc", "etl")}
            out[(key, wname)] = dict(rows=rows, jain=jain, small_lost=small_lost, small_off=small_off, batch=batch)
            full_all = [r for r in started if r.ok and not r.degraded]
            eng = sum(work.get(id(r), 0.0) for r in full_all) or 1.0
            lc_share = 100 * sum(work.get(id(r), 0.0) for r in full_all if r.kind == "lc") / eng
            etl_share = 100 * sum(work.get(id(r), 0.0) for r in full_all if r.kind == "etl") / eng
            live = admitter.read(t0, t1)
            live_mean = sum(live) / len(live) if live else float("nan")
            smalls = [k for k in small if k not in ("t05",)]
            p99s = max(rows[k]["p99"] for k in smalls if rows[k]["p99"] == rows[k]["p99"])
            if summary:
                t5 = rows["t05"]
                print(f"| {seed} | {key} {MODES[key]} | {wname} | {rows['t01']['served']:.1f} / {rows['t01']['due']:.1f} "
                      f"| {t5['served']:.1f} / {t5['due']:.1f}, lost {t5['degraded'] + t5['refused']} (under g "
                      f"{t5['under']}) | {sum(rows[k]['degraded'] + rows[k]['refused'] for k in smalls)} / "
                      f"{sum(offered[k] for k in smalls)} | {p99s:.2f} | {jain:.3f} | {live_mean:.3f} "
                      f"| {lc_share:.1f} / {etl_share:.1f} | {batch['lc'][0]}/{batch['lc'][1]}, "
                      f"{batch['etl'][0]}/{batch['etl'][1]} |", flush=True)
                continue
            print(f"\n### seed {seed}, mode {key} ({MODES[key]}), window {wname} ({t0:g}-{t1:g} s): "
                  f"class engine time {cap:.1f} s; Jain(served/due) {jain:.3f}; tenants due all they asked: "
                  f"{len(small)}, lost {small_lost} of {small_off} requests (degraded or refused); batch full/offered "
                  + ", ".join(f"{k} {a}/{b}" for k, (a, b) in batch.items()))
            print("| tenant | w | g | offered | asked % | due % | served % | served/due | p99 s | goodput req/s "
                  "| late | degraded | refused | lost under g |")
            print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
            for k in inter:
                if show and k not in show:
                    continue
                r = rows[k]
                ratio = r["served"] / r["due"] if r["due"] else float("nan")
                print(f"| {k} | {weight[k]:g} | {floor[k]:g} | {r['offered']} | {r['asked']:.1f} | {r['due']:.1f} "
                      f"| {r['served']:.1f} | {ratio:.2f} | {r['p99']:.2f} | {r['goodput']:.2f} | {r['late']} "
                      f"| {r['degraded']} | {r['refused']} | {r['under'] if floor[k] else '-'} |")
        if owed_check:
            print(f"\nmode {key}: owed() asked for a flow holding nothing {OWED_ASKED[f'{seed}{key}']} times; "
                  f"said no only because its share x the class's hold < one request: {OWED_NO[f'{seed}{key}']}")
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="701")
    ap.add_argument("--modes", default="cde")
    ap.add_argument("--tenants", default="", help="comma list of tenants to print (all by default)")
    ap.add_argument("--owed", action="store_true", help="count owner's-return refusals from share granularity")
    ap.add_argument("--variant", default="", choices=["", "borrow", "owed1"],
                    help="borrow: the policies with limit.borrow_lower; owed1: a flow holding nothing is owed one "
                         "request (a bench-only counterfactual of PoolGate.owed)")
    ap.add_argument("--summary", action="store_true", help="one line per seed, mode and window")
    ap.add_argument("--scenario", default=SCENARIO, help="another scenario of the same tenants (a no-flood baseline)")
    a = ap.parse_args()
    SCENARIO_PATH[0] = a.scenario
    if a.summary:
        print("| seed | mode | window | t01 served / due % | t05 served / due %, lost | 22 small tenants lost / "
              "offered | small tenants' worst p99 s | Jain served/due | extproc_class_fairness_index, window mean "
              "| lc / etl engine % | lc, etl full / offered |")
        print("|---|---|---|---|---|---|---:|---:|---:|---|---|")
    for s in a.seeds.split(","):
        run(int(s), a.modes.replace(",", ""), [t for t in a.tenants.split(",") if t] or None, a.owed, a.variant,
            a.summary)
