"""`extproc check FILE`: validate a policy without starting anything; every error names its key path."""

from __future__ import annotations

import argparse
import sys

from extproc.policy.schema import PolicyError, load_policy_file, policy_warnings


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", metavar="FILE", help="policy YAML file(s)")


def run(args: argparse.Namespace) -> int:
    failed = False
    for path in args.files:
        try:
            policy = load_policy_file(path)
        except PolicyError as e:
            failed = True
            print(f"{path}: invalid", file=sys.stderr)
            for line in e.errors:
                print(f"  {line}", file=sys.stderr)
            continue
        for w in policy_warnings(policy):
            print(f"{path}: warning: {w}", file=sys.stderr)
        classes = ", ".join(f"{n}={c.max_concurrency}" for n, c in policy.classes.items())
        print(f"{path}: ok ({_count(policy.classes, 'class', 'classes')}: {classes}; "
              f"{_count(policy.models, 'model', 'models')}; {_count(policy.tenants, 'tenant', 'tenants')})")
    return 1 if failed else 0


def _count(items, one: str, many: str) -> str:
    return f"{len(items)} {one if len(items) == 1 else many}"
