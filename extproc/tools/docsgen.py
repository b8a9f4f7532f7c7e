"""Generate docs/configuration.md, the policy reference, from the schema in extproc/policy/schema.py.

    python -m extproc.tools.docsgen > docs/configuration.md     # regenerate
    python -m extproc.tools.docsgen --check docs/configuration.md   # exit 1 if the committed reference is stale
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from extproc.policy.schema import Policy

HEADER = """\
# Policy configuration reference

<!-- Generated from extproc/policy/schema.py by `python -m extproc.tools.docsgen > docs/configuration.md`.
     Do not edit by hand: change the schema's docs and regenerate (a test fails when this file is stale). -->

Every key of the policy YAML (`extproc serve --policy FILE`), its type, default and meaning. Validate a file with
`extproc check FILE`: errors name the key path as written here (`classes.batch.max_queue`, `tenants[0].name`);
`extproc check --envoy envoy/envoy.yaml FILE` also refuses a model whose `cluster` that Envoy config lacks, and
routes or ext_proc settings that let requests reach a model pool unadmitted or on another pool than they were
counted against (docs/envoy-integration.md, section 7).
The ext_proc reloads the file on change or SIGHUP; an invalid file is refused and the running policy stays. From its
start: the CLI ignores SIGHUP before it imports the server, until the server takes it over; the Python
interpreter's own start before that (about 30 ms from exec on an idle machine, more under load) is left to SIGHUP's
default action, which ends the process. A launcher that may signal it that early starts it
with SIGHUP ignored (`nohup`, or `trap '' HUP` before `exec extproc serve`): the server still takes it over for
reloads, as `--workers`' children do. Signals
that come while a reload waits for its turn are that reload (it reads the file as it is when its turn comes), and
a file byte for byte the one applied last is not parsed again: a burst of SIGHUPs costs at most one parse after
the one running. A file of 32 kB or more (a few hundred tenants) is parsed in a child process: a 2,000-tenant
file takes most of a second of YAML, which in the server's own process slowed every decision meanwhile. An
applied reload logs what it changed (`policy reloaded from FILE: classes -internal; classes.interactive.max_concurrency
48 -> 24`). Requests in flight finish under the policy that admitted them, holding their slots; queued ones keep
waiting, except those of a removed class (503 `class_removed`) and, when `anonymous.allow` is false, anonymous ones
and those of a removed tenant (401 `missing_api_key` or `invalid_api_key`, as they now get at arrival). A tenant's
rate-limit buckets keep what was left of them (within the new depth, debts included): raising its limits (a plan
upgrade) hands out no fresh burst, the bucket fills to its new depth at the new rate (within `burst_s` when idle; a
tenant moved from 20,000 to 200,000 tokens a minute answered `x-ratelimit-remaining-tokens: 23722` right after the
reload), and lowering them cuts what is left to the new depth. The breakers of a class or pool (a cluster no model
routes to any more) the reload removed go, with their `extproc_breaker_*` series, and so do a removed pool's (or
pool-wide limit's) `extproc_pool_yields_total` and `extproc_pool_limit_moves_total` series; a pool put back starts
afresh: its breakers closed, its limit at `initial`, its names from replicas once they are read again.

In key paths, `<name>` stands for a key you choose (a class or model name) and `[]` for a list item.
"""


@dataclasses.dataclass
class Section:
    path: str          # key path of this mapping ("" for the top level)
    cls: type          # the schema dataclass describing it


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _anchor(path: str) -> str:
    """GitHub's heading anchor for a section titled `path` in backticks."""
    return "".join(c for c in path.lower() if c.isalnum() or c in "-_ ").replace(" ", "-")


def _type_name(tp: Any, path: str, found: list[Section]) -> str:
    """Human type of `tp` at key `path`; nested dataclasses are queued in `found` as their own sections."""
    tp, _ = _unwrap_optional(tp)
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(f"`{v}`" for v in typing.get_args(tp))
    if origin is list:
        (item,) = typing.get_args(tp)
        return f"list of {_plural(_type_name(item, f'{path}[]', found))}"
    if origin is dict:
        _, item = typing.get_args(tp)
        return f"map: name → {_type_name(item, f'{path}.<name>', found)}"
    if dataclasses.is_dataclass(tp):
        found.append(Section(path, tp))
        return f"[mapping](#{_anchor(path)})"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(f"`{m.value}`" for m in tp)
    return {int: "integer", float: "number", str: "string", bool: "boolean"}.get(tp, getattr(tp, "__name__", str(tp)))


def _plural(name: str) -> str:
    return {"integer": "integers", "number": "numbers", "string": "strings", "boolean": "booleans"}.get(name, name)


def _default(f: dataclasses.Field) -> str:
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
        return "**required**"
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if value is None:
        return "unset"
    if dataclasses.is_dataclass(value):
        return "all defaults"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, enum.Enum):
        return f"`{value.value}`"
    if isinstance(value, (list, dict)) and not value:
        return "`[]`" if isinstance(value, list) else "`{}`"
    return f"`{value}`"


def _bounds(f: dataclasses.Field) -> str:
    lo, hi = f.metadata.get("min"), f.metadata.get("max")
    if lo is not None and hi is not None:
        return f"{lo:,} – {hi:,}"
    if lo is not None:
        return f"≥ {lo:,}"
    if hi is not None:
        return f"≤ {hi:,}"
    return ""


def _cell(text: str) -> str:
    """One table cell: one line, pipes escaped, and `<word>` outside code spans kept visible (not read as HTML)."""
    parts = " ".join(text.split()).replace("|", "\\|").split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def render(root: type = Policy) -> str:
    """The whole reference, top level first, then each nested mapping in the order its key appears."""
    out = [HEADER]
    queue = [Section("", root)]
    seen: set[str] = set()
    while queue:
        section = queue.pop(0)
        if section.path in seen:
            continue
        seen.add(section.path)
        title = f"`{section.path}`" if section.path else "Top level"
        out.append(f"## {title}\n")
        out.append(f"{_cell(section.cls.__doc__ or '')}\n")
        out.append("| key | type | default | bounds | meaning |")
        out.append("|---|---|---|---|---|")
        hints = typing.get_type_hints(section.cls)
        nested: list[Section] = []
        for f in dataclasses.fields(section.cls):
            path = f"{section.path}.{f.name}" if section.path else f.name
            type_name = _type_name(hints[f.name], path, nested)
            out.append(f"| `{path}` | {type_name} | {_default(f)} | {_bounds(f)} | {_cell(f.metadata.get('doc', ''))} |")
        out.append("")
        queue.extend(nested)
    return "\n".join(out).rstrip() + "\n"


BEGIN_REASONS = "<!-- reasons: generated from extproc/policy/reasons.py by `make docs`; edit them there -->"
END_REASONS = "<!-- end of the generated reasons -->"


def troubleshooting(page: str) -> str:
    """`page` (docs/troubleshooting.md) with its per-reason sections rendered anew from the reason table."""
    from extproc.policy.reasons import REASONS, SECTIONS

    out = [BEGIN_REASONS, ""]
    for section, intro in SECTIONS.items():
        out += [f"## {section}", ""] + ([intro, ""] if intro else [])
        for r in REASONS.values():
            if r.section == section:
                out += [f"### `{r.code}`", r.help, ""]
    head, _, rest = page.partition(BEGIN_REASONS)
    _, _, tail = rest.partition(END_REASONS)
    return head + "\n".join(out) + END_REASONS + tail


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m extproc.tools.docsgen", description=__doc__.splitlines()[0])
    p.add_argument("--check", metavar="FILE", help="compare with FILE instead of printing; exit 1 if it differs")
    p.add_argument("--troubleshooting", metavar="FILE", help="rewrite the reason sections of FILE in place")
    args = p.parse_args(argv)
    if args.troubleshooting:
        path = Path(args.troubleshooting)
        path.write_text(troubleshooting(path.read_text(encoding="utf-8")), encoding="utf-8")
        return 0
    text = render()
    if args.check is None:
        sys.stdout.write(text)
        return 0
    path = Path(args.check)
    current = path.read_text(encoding="utf-8") if path.exists() else ""
    if current != text:
        print(f"{path} is stale: regenerate with `python -m extproc.tools.docsgen > {path}`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
