"""`extproc check FILE`: validate a policy without starting anything; every error names its key path."""

from __future__ import annotations

import argparse
import sys

from extproc.policy.schema import ClassSpec, Policy, PolicyError, load_policy_file, policy_warnings
from extproc.server.protocol import MAX_BODY_BYTES, MAX_PENDING_BODIES
from extproc.tools import envoylint


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", metavar="FILE", help="policy YAML file(s)")
    p.add_argument("--envoy", metavar="ENVOY_YAML",
                   help="also refuse models whose `cluster` this Envoy config's static_resources does not define, "
                        "and routes or filter settings that let requests reach those clusters unadmitted "
                        "(e.g. envoy/envoy.yaml)")
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES, metavar="N",
                   help="with --envoy: the ext_proc's `serve --max-body-bytes` (Envoy's body buffers must stay "
                        "within its gRPC receive limit)")
    p.add_argument("--max-pending-bodies", type=int, default=MAX_PENDING_BODIES, metavar="N",
                   help="with --envoy: the ext_proc's `serve --max-pending-bodies` (the ext_proc cluster's circuit "
                        "breaker must stay above it)")


def run(args: argparse.Namespace) -> int:
    clusters = envoy = None
    if args.envoy:
        try:
            envoy = _load_yaml(args.envoy)
            dynamic = envoy.get("dynamic_resources") if isinstance(envoy, dict) else None
            if dynamic is not None and not isinstance(dynamic, dict):  # Envoy refuses it too; lint reads a mapping
                raise ValueError(f"dynamic_resources: a {type(dynamic).__name__}, not a mapping (not an Envoy "
                                 "bootstrap config?)")
            if (dynamic or {}).get("cds_config") is not None:
                # Its pools may be any of the clusters CDS serves: only the routes and filters can be checked.
                print(f"{args.envoy}: warning: its clusters come from CDS: the models' `cluster` names are not "
                      "checked", file=sys.stderr)
            else:
                clusters = envoy_clusters(envoy)
        except (OSError, ValueError) as e:
            print(f"{args.envoy}: {e}", file=sys.stderr)
            return 2
    failed = False
    needs = _EnvoyNeeds(args.max_body_bytes, args.max_pending_bodies)
    for path in args.files:
        try:
            policy = load_policy_file(path)
            if clusters is not None:
                _check_clusters(policy, args.envoy, clusters)
        except PolicyError as e:
            failed = True
            print(f"{path}: invalid", file=sys.stderr)
            for line in e.errors:
                print(f"  {line}", file=sys.stderr)
            continue
        needs.add(policy)
        for w in policy_warnings(policy):
            print(f"{path}: warning: {w}", file=sys.stderr)
        classes = ", ".join(f"{n}={c.max_concurrency}" for n, c in policy.classes.items())
        print(f"{path}: ok ({_count(policy.classes, 'class', 'classes')}: {classes}; "
              f"{_count(policy.models, 'model', 'models')}; {_count(policy.tenants, 'tenant', 'tenants')})")
    if envoy is not None and needs.pools and not _report_envoy(args.envoy, envoy, needs):
        failed = True
    return 1 if failed else 0


class _EnvoyNeeds:
    """What the valid policies checked need of the Envoy config (any of them may run behind it)."""

    def __init__(self, max_body_bytes: int, max_pending_bodies: int) -> None:
        self.max_body_bytes = max_body_bytes  # the ext_proc's serve flags of those names
        self.max_pending_bodies = max_pending_bodies
        self.pools: set[str] = set()
        self.admitted = 0             # the most requests a policy admits at once
        self.longest_wait_s = 0.0     # the longest a policy lets a request queue
        self.store_call_s = 0.0       # the longest a policy's shared store call may take
        self.reads = set(envoylint.READS)  # the request headers the ext_proc reads

    def add(self, policy: Policy) -> None:
        self.pools |= {m.cluster for m in policy.models.values()}
        self.admitted = max(self.admitted, sum(map(_most_held, policy.classes.values())))
        self.longest_wait_s = max([self.longest_wait_s] + [c.max_wait_ms / 1000 for c in policy.classes.values()])
        if policy.store.kind == "redis":
            self.store_call_s = max(self.store_call_s, policy.store.timeout_ms / 1000)
        c = policy.classify
        self.reads |= {h for h in (c.header, policy.sessions.header, c.objective_header, c.fairness_header,
                                   c.deadline_header) if h}


def _most_held(c: ClassSpec) -> int:
    """The most requests a class holds at once: its cap, where an adaptive one may rise to, and a degrade's own
    slots (policy.state: `fallback.max_concurrency`, else the class's cap) on top."""
    cap = c.adaptive.max_limit if c.adaptive.enabled else c.max_concurrency
    degraded = (c.fallback.max_concurrency or c.max_concurrency) if c.fallback.action == "degrade" else 0
    return cap + degraded


def _report_envoy(path: str, cfg: dict, needs: _EnvoyNeeds) -> bool:
    """Print what lets requests for the policies' pools around admission in this Envoy config; False if anything
    does."""
    try:
        found = envoylint.lint(cfg, needs.pools, needs.admitted, needs.longest_wait_s, tuple(sorted(needs.reads)),
                               needs.store_call_s, needs.max_body_bytes, needs.max_pending_bodies)
    except (AttributeError, TypeError, KeyError, StopIteration, ValueError) as e:  # a shape Envoy would refuse
        print(f"{path}: invalid: its listeners are not an Envoy config this check can read ({e!r}); validate it "
              "with `envoy --mode validate -c` first", file=sys.stderr)
        return False
    for w in found.warnings:
        print(f"{path}: warning: {w}", file=sys.stderr)
    if found.errors:
        print(f"{path}: invalid (requests can reach a model pool without admission, or on another pool)",
              file=sys.stderr)
        for line in found.errors:
            print(f"  {line}", file=sys.stderr)
    return not found.errors


def _load_yaml(path: str) -> dict:
    import yaml

    with open(path, encoding="utf-8") as f:
        try:
            return yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ValueError(f"not valid YAML: {e}") from e
        except RecursionError as e:  # PyYAML parses nested collections recursively
            raise ValueError("not valid YAML: nested too deeply (an Envoy config needs a few dozen levels)") from e


def envoy_clusters(cfg: dict) -> set[str]:
    """The upstream clusters an Envoy config defines statically (the ext_proc's own left out)."""
    try:
        names = [c["name"] for c in cfg["static_resources"]["clusters"]]
    except (KeyError, TypeError) as e:
        raise ValueError("no static_resources.clusters with names (not an Envoy bootstrap config?)") from e
    odd = next((i for i, n in enumerate(names) if not isinstance(n, str)), None)
    if odd is not None:  # Envoy refuses it too; a number among the names cannot be sorted into the message
        raise ValueError(f"static_resources.clusters[{odd}].name: {names[odd]!r} is not a string")
    return set(names) - {"extproc"}


def _check_clusters(policy: Policy, envoy: str, clusters: set[str]) -> None:
    """A model routed to a cluster Envoy does not have is admitted, then answered 503 `cluster_not_found` by Envoy
    (outcome not_routed, every request of the model): a typo that validates on its own."""
    errors = [f"models.{name}.cluster: {m.cluster!r} is not a cluster of {envoy} (clusters: "
              f"{', '.join(sorted(clusters))}); Envoy answers its requests 503 cluster_not_found: fix the name or "
              "add the cluster" for name, m in policy.models.items() if m.cluster not in clusters]
    if errors:
        raise PolicyError(errors)


def _count(items, one: str, many: str) -> str:
    return f"{len(items)} {one if len(items) == 1 else many}"
