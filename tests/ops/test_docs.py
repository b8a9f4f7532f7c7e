"""The docs users need: the generated configuration reference is current, troubleshooting covers every reason."""

from __future__ import annotations

import dataclasses
import enum
import re
import subprocess
import sys
from typing import Literal

import pytest
import yaml

from extproc.policy.limits import Outcome
from extproc.policy.reasons import REASONS
from extproc.tools import docsgen

from .conftest import ROOT

DOCS = ROOT / "docs"


def test_configuration_reference_is_current():
    r = subprocess.run([sys.executable, "-m", "extproc.tools.docsgen", "--check", str(DOCS / "configuration.md")],
                       capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert r.returncode == 0, r.stderr


def test_reference_lists_every_key_path_of_the_schema():
    text = docsgen.render()
    for path in ("classes", "classes.<name>.max_concurrency", "classes.<name>.max_wait_ms", "models.<name>.cluster",
                 "classify.header", "tenants[].api_keys", "anonymous.max_class", "shed", "mode", "lease_ms"):
        assert f"| `{path}` |" in text, path
    assert "| `classes.<name>.max_wait_ms` | integer | `200` | 0 – 29,000 |" in text


def test_check_fails_on_a_stale_reference(tmp_path):
    stale = tmp_path / "configuration.md"
    stale.write_text(docsgen.render().replace("max_queue", "max_queue_old"))
    assert docsgen.main(["--check", str(stale)]) == 1
    stale.write_text(docsgen.render())
    assert docsgen.main(["--check", str(stale)]) == 0


class Kind(enum.Enum):
    STATIC = "static"
    AIMD = "aimd"


@dataclasses.dataclass(frozen=True)
class Inner:
    """An inner mapping."""

    ratio: float = dataclasses.field(default=0.5, metadata={"doc": "A ratio.", "min": 0, "max": 1})


@dataclasses.dataclass(frozen=True)
class Outer:
    """A schema with the shapes the policy will grow into."""

    inner: Inner | None = dataclasses.field(default=None, metadata={"doc": "Optional nested mapping."})
    pools: dict[str, Inner] = dataclasses.field(default_factory=dict, metadata={"doc": "Named mappings."})
    steps: list[Inner] = dataclasses.field(default_factory=list, metadata={"doc": "Listed mappings."})
    kind: Kind = dataclasses.field(default=Kind.STATIC, metadata={"doc": "An enum."})
    mode: Literal["a", "b"] = dataclasses.field(default="a", metadata={"doc": "A literal."})
    on: bool = dataclasses.field(default=True, metadata={"doc": "A flag."})


def test_renders_nested_optional_enum_and_float_fields():
    text = docsgen.render(Outer)
    assert "| `inner` | [mapping](#inner) | unset |" in text
    assert "| `inner.ratio` | number | `0.5` | 0 – 1 | A ratio. |" in text
    assert "## `pools.<name>`" in text and "## `steps[]`" in text
    assert "| `kind` | one of `static`, `aimd` | `static` |" in text
    assert "| `mode` | one of `a`, `b` | `a` |" in text
    assert "| `on` | boolean | `true` |" in text


def reasons_in_code() -> set[str]:
    """Every reason the ext_proc can emit: R_* constants, BadRequest codes (explicit and default)."""
    reasons = set()
    for path in (ROOT / "extproc").rglob("*.py"):
        if "sim" in path.relative_to(ROOT / "extproc").parts:
            continue
        text = path.read_text()
        reasons |= set(re.findall(r'^R_\w+\s*=\s*"(\w+)"', text, re.M))
        if path.parent.name == "server":
            reasons |= set(re.findall(r'\bcode(?::\s*str)?\s*=\s*"(\w+)"', text))
    return reasons


def test_every_reason_the_code_gives_is_in_the_reason_table():
    reasons = reasons_in_code()
    # A few of each kind, so a scan that silently finds nothing fails: core reasons, breakers, request-body codes.
    assert {"queue_full", "higher_class_saturated", "latency_breaker_open", "error_breaker_open", "invalid_json",
            "invalid_body", "body_too_large"} <= reasons
    assert not reasons - set(REASONS), sorted(reasons - set(REASONS))


def test_troubleshooting_is_generated_from_the_reason_table():
    page = (DOCS / "troubleshooting.md").read_text()
    assert docsgen.troubleshooting(page) == page, "stale: run `make docs`"
    headings = set(re.findall(r"^#+ `(\w+)`$", page, re.M))
    assert set(REASONS) <= headings


def test_troubleshooting_explains_every_outcome():
    text = (DOCS / "troubleshooting.md").read_text()
    for outcome in Outcome:
        assert f"- `{outcome.value}`:" in text, outcome


def test_docs_name_only_alerts_and_rules_that_exist():
    rules = (ROOT / "compose" / "prometheus" / "rules" / "extproc.rules.yml").read_text()
    defined = set(re.findall(r"(?:alert|record): (\S+)", rules))
    for page in DOCS.glob("*.md"):
        for name in re.findall(r"`(Extproc\w+|\w+:extproc\w*:\w+|extproc:\w+:\w+)`", page.read_text()):
            assert name in defined, (page.name, name)


OPS_PAGES = ("configuration.md", "envoy-integration.md", "tuning.md", "troubleshooting.md", "autoscaling.md")


def test_docs_link_only_to_files_that_exist():
    for page in (DOCS / name for name in OPS_PAGES):
        for ref in re.findall(r"`((?:docs|compose|deploy|envoy|policies|extproc)/[\w./-]+\.\w+)`", page.read_text()):
            assert (ROOT / ref).exists(), (page.name, ref)


def test_envoy_integration_snippets_match_envoy_yaml():
    text = (DOCS / "envoy-integration.md").read_text()
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, re.S)]
    envoy = (ROOT / "envoy" / "envoy.yaml").read_text()
    hcm = yaml.safe_load(envoy)["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    shipped_filter = hcm["http_filters"][0]
    (doc_filter,) = [b[0] for b in blocks if isinstance(b, list) and b[0].get("name") == shipped_filter["name"]]
    for key in ("processing_mode", "failure_mode_allow", "message_timeout", "max_message_timeout",
                "allow_mode_override", "response_attributes"):
        assert doc_filter["typed_config"][key] == shipped_filter["typed_config"][key], key
    (doc_log,) = [b["access_log"] for b in blocks if isinstance(b, dict) and "access_log" in b]
    assert doc_log == hcm["access_log"]
    (doc_early,) = [b["early_header_mutation_extensions"] for b in blocks
                    if isinstance(b, dict) and "early_header_mutation_extensions" in b]
    assert doc_early == hcm["early_header_mutation_extensions"]
    (doc_paths,) = [b for b in blocks if isinstance(b, dict) and "normalize_path" in b]
    assert doc_paths == {k: hcm[k] for k in ("normalize_path", "merge_slashes", "path_with_escaped_slashes_action")}
    (doc_replies,) = [b["local_reply_config"] for b in blocks if isinstance(b, dict) and "local_reply_config" in b]
    assert doc_replies == hcm["local_reply_config"]


def test_envoy_yaml_comments_name_only_files_that_exist():
    """envoy/envoy.yaml is the file infra teams read first: a path its comments name must be there."""
    text = (ROOT / "envoy" / "envoy.yaml").read_text()
    comments = "\n".join(line.split("#", 1)[1] for line in text.splitlines() if "#" in line)
    refs = re.findall(r"(?<![\w/.-])((?:docs|compose|deploy|envoy|policies|extproc|scripts|tests)/[\w./-]*\w\.\w+)",
                      comments)
    assert "deploy/k8s/base/vllm-llama70b.yaml" in refs  # the scan finds what the comments name
    for ref in refs:
        assert (ROOT / ref).exists(), ref


def test_troubleshooting_names_every_final_decision_and_where_the_reason_header_is():
    """The page's header says which decisions exist and which answers carry x-extproc-reason: check both against
    the responses the ext_proc builds (a refusal of each kind, a request refused before admission)."""
    from extproc.policy.decision import ACCEPT, DEGRADE, INVALID, QUEUE, REJECT, SHED, Refusal
    from extproc.server import protocol
    from extproc.server.openai import BadRequest

    text = (DOCS / "troubleshooting.md").read_text()
    intro = text.split("Where to read it", 1)[0]
    named = set(re.findall(r"`(\w+)`", intro.split("**decision**", 1)[1].split("**reason**", 1)[0]))
    assert named == {ACCEPT, DEGRADE, REJECT, SHED, INVALID} and QUEUE not in named, named

    def headers(resp):
        return {h.header.key: h.header.raw_value.decode() or h.header.value
                for h in resp.immediate_response.headers.set_headers}

    carry = {kind for kind in (REJECT, SHED)
             if "x-extproc-reason" in headers(protocol.refusal(Refusal(kind, "queue_full", "batch", "t", 429, "m")))}
    invalid = Refusal(INVALID, "invalid_json", "batch", "t", 400, "m")
    if "x-extproc-reason" in headers(protocol.bad_request(BadRequest("m", code="invalid_json"), invalid)):
        carry.add(INVALID)
    (row,) = [line for line in text.splitlines() if line.startswith("| response headers |")]
    said = set(re.findall(r"`(\w+)`", row.split("`x-extproc-reason` on", 1)[1].split(";", 1)[0]))
    assert said == carry, (said, carry)


# Where the docs show a command: fenced blocks (continuation lines joined, `# comments` dropped) and inline code.
def doc_commands() -> list[tuple[str, str]]:
    out = []
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        text = page.read_text()
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
            out += [(page.name, line.split(" #", 1)[0]) for line in block.replace("\\\n", " ").splitlines()]
        out += [(page.name, code) for code in re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))]
    return out


def _options(parser) -> set[str]:
    return set(parser._option_string_actions)


def test_commands_in_the_docs_name_subcommands_and_flags_that_exist():
    """A user types what the docs show: `extproc SUB --flag`, `bench/X.py --flag` and `make TARGET` must exist."""
    import argparse
    import importlib

    from extproc.cli import SUBCOMMANDS

    def extproc_options(name: str) -> set[str]:
        p = argparse.ArgumentParser()
        importlib.import_module(SUBCOMMANDS[name][0]).add_arguments(p)
        return _options(p)

    def bench_options(script: str) -> set[str]:
        r = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert r.returncode == 0, (script, r.stderr)
        return set(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", r.stdout))

    makefiles = (ROOT / "Makefile").read_text() + (ROOT / "Makefile.vllm").read_text()
    targets = set(re.findall(r"^([\w-]+)\s*:(?!=)", makefiles, re.M))
    options: dict[str, set[str]] = {}
    wrong, seen = [], 0
    for page, cmd in doc_commands():
        for target in re.findall(r"(?:^|[;&|(]\s*)make ([\w-]+)", cmd):
            seen += 1
            if target not in targets:
                wrong.append((page, f"make {target}"))
        for m in re.finditer(r"(?:(?<![\w/.-])extproc ([a-z][\w-]*)|(bench/\w+\.py))([^;`]*?)(?=&&|$)", cmd):
            name = m.group(1) or m.group(2)
            if m.group(1) and name not in SUBCOMMANDS:
                wrong.append((page, f"extproc {name}"))
                continue
            if name not in options:
                options[name] = extproc_options(name) if m.group(1) else bench_options(name)
            for flag in re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", m.group(3)):
                seen += 1
                if flag not in options[name]:
                    wrong.append((page, f"{name} {flag}"))
    assert seen > 100  # the scan finds the commands (about 150 flags and targets today)
    assert not wrong, wrong


def test_metrics_the_docs_name_exist(known_metric_names):
    """An operator greps /metrics or writes a query for the name a doc gives: every ext_proc metric named in inline
    code (`extproc_...`, with or without a label set, and the rules' `level:extproc_...:op` names) is one the
    ext_proc exports or a rule records."""
    named = set()
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        prose = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for code in re.findall(r"`([^`\n]+)`", prose):
            named |= {(page.name, n) for n in re.findall(r"(?<![\w:])(\w+:extproc\w*:\w+|extproc_\w*[a-z0-9])\b", code)}
    assert len({n for _, n in named}) > 40  # the scan finds them (about 60 distinct names today)
    unknown = sorted((page, name) for page, name in named if name not in known_metric_names)
    assert not unknown, unknown


def test_readme_stack_says_where_to_send_requests():
    """README's "Running it yourself" starts the ext_proc, the simulators and Envoy: it must say where the API
    listens (it gave the ext_proc's ports only, so a newcomer had no address to send a request to) and its example
    must reach it: the listener envoy-config renders by default, a path with a route, a model and key the policy
    knows, and the ext_proc's ports as `extproc serve` defaults them."""
    import argparse

    from extproc.policy.schema import load_policy_file
    from extproc.server import main as serve
    from extproc.tools import envoyconf

    (block,) = re.findall(r"## Running it yourself\n+```sh\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    block = block.replace("\\\n", " ")
    ((host, port, path, body),) = re.findall(
        r"^curl .*?(localhost|127\.0\.0\.1):(\d+)(/\S+) .*-d '(\{.*\})'", block, re.M)
    p = argparse.ArgumentParser()
    envoyconf.add_arguments(p)
    assert int(port) == p.parse_args([]).listen[1]
    assert f"127.0.0.1:{port}" in block.split("envoy -c", 1)[1].splitlines()[0]  # the comment says where
    routes = yaml.safe_load((ROOT / "envoy" / "envoy.yaml").read_text())["static_resources"]["listeners"][0][
        "filter_chains"][0]["filters"][0]["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    assert any(r["match"].get("path") == path for r in routes), path
    policy = load_policy_file(str(ROOT / "policies" / "default.yaml"))
    assert yaml.safe_load(body)["model"] in policy.models
    key = re.search(r"Bearer ([\w-]+)", block).group(1)
    assert any(key in t.api_keys for t in policy.tenants)
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    defaults = p.parse_args(["--policy", "x"])
    assert f"gRPC :{defaults.grpc[1]}, /metrics and /healthz on :{defaults.metrics[1]}" in block


def test_demo_page_names_the_modes_that_run_the_ext_proc():
    """docs/demo.md says which modes start an ext_proc; it said c and d after mode e (adaptive caps, which runs
    one too) was added."""
    from extproc.tools.demo.modes import MODES

    text = (DOCS / "demo.md").read_text()
    (said,) = re.findall(r"and for modes ([a-e, and]+?) the ext_proc", text)
    assert set(re.findall(r"\b[a-e]\b", said)) == {k for k, m in MODES.items() if m.stack_mode == "extproc"}


def test_tuning_playbook_signals_are_dashboard_panels():
    """docs/tuning.md gives each step's signal as a dashboard panel in bold; an operator looks for that title.
    It said "Latency p95 vs SLO" and "Refused share", titles the dashboard does not have."""
    import json

    from extproc.policy.decision import SHED

    def titles(panels):
        for p in panels:
            yield p["title"]
            yield from titles(p.get("panels", []))

    dashboard = json.loads((ROOT / "compose" / "grafana" / "dashboards" / "extproc.json").read_text())
    # A title's parenthesised detail may be left out: "Client latency p95 (arrival to end, ...) vs SLO".
    known = {" ".join(re.sub(r"\([^)]*\)", "", t).split()) for t in titles(dashboard["panels"])}
    text = (DOCS / "tuning.md").read_text()
    steps = text.split("## 1. Shadow", 1)[1].split("## 4.", 1)[0]
    leads = re.findall(r"^- \*\*(.+?)\*\*", steps, re.M)
    assert len(leads) >= 6
    assert not [lead for lead in leads if lead not in known and lead.lower() != SHED], leads


def test_files_the_docs_commands_and_code_name_exist():
    """The check above covers the operations pages' own links; a user also runs `extproc demo --scenario
    scenarios/X.yaml`, `python bench/X.py` or opens `tests/...` from any page or the README. Every repository path in
    a command or inline code must be there (placeholders in capitals, and the user's own overlay, excepted)."""
    refs = [(page, ref) for page, code in doc_commands()
            for ref in re.findall(r"(?<![\w/.-])((?:docs|compose|deploy|envoy|policies|extproc|bench|scenarios|"
                                  r"workloads|scripts|tests)/[\w./-]*\w\.\w+)", code)]
    assert len(refs) > 200  # the scan finds them (about 330 today)
    missing = [(page, ref) for page, ref in refs
               if not (ROOT / ref).exists() and not re.search(r"[A-Z]{3,}|/mine/", ref)]
    assert not missing, missing


# Policy YAML the docs show: fenced ```yaml blocks whose top-level keys include a policy key (Envoy, Kubernetes
# and workload blocks have none), and inline `key.path: value` / `key: {flow}` whose first key is a policy key.
# A snippet is part of a policy: it is merged into policies/default.yaml and the result must load.
def policy_snippets(pages: list[tuple[str, str]]) -> list[tuple[str, str, dict]]:
    from extproc.policy.schema import Policy

    top = {f.name for f in dataclasses.fields(Policy)}
    out = []
    for name, text in pages:
        for block in re.findall(r"```ya?ml\n(.*?)```", text, re.S):
            data = yaml.safe_load(block)
            if isinstance(data, dict) and set(data) & top:
                out.append((name, block, data))
        for code in re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S)):
            m = re.fullmatch(r"([a-z_]+(?:\.[a-z_]+)*):\s+(\S.*)", code)
            if m and m.group(1).split(".")[0] in top:
                data = yaml.safe_load(m.group(2))
                for key in reversed(m.group(1).split(".")):
                    data = {key: data}
                out.append((name, code, data))
    return out


def load_policy_snippet(snippet: dict):
    """The shipped default policy with `snippet` merged over it (mappings key by key, anything else replaced)."""
    from extproc.policy.schema import load_policy

    def merged(base, over):
        if not (isinstance(base, dict) and isinstance(over, dict)):
            return over
        return {**base, **{k: merged(base.get(k), v) for k, v in over.items()}}

    return load_policy(merged(yaml.safe_load((ROOT / "policies" / "default.yaml").read_text()), snippet))


def doc_pages() -> list[tuple[str, str]]:
    return [(page.name, page.read_text()) for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]]


def test_policy_snippets_in_the_docs_validate():
    """A platform engineer copies a doc's policy YAML into their own file: every snippet (a block, or inline
    `store.on_failure: local`) must load with the real loader, which refuses an unknown key or a wrong value."""
    from extproc.policy.schema import PolicyError

    snippets = policy_snippets(doc_pages())
    assert sum(isinstance(shown, str) and "\n" in shown for _, shown, _ in snippets) >= 3  # the scan finds blocks
    assert len(snippets) > 20  # and inline ones (27 snippets in all today)
    bad = []
    for page, shown, data in snippets:
        try:
            load_policy_snippet(data)
        except PolicyError as e:
            bad.append((page, shown, str(e)))
    assert not bad, bad
    # The check can fail: an unknown key in a block, a wrong value inline.
    wrong = [("x.md", "```yaml\nstore:\n  kind: redis\n  lease_sec: 5\n```\n"
                      "`mode: enforced` and `fleet.requests_per_minute: 0`")]
    found = policy_snippets(wrong)
    assert len(found) == 3
    for _, _, data in found:
        with pytest.raises(PolicyError):
            load_policy_snippet(data)


def test_policy_keys_the_docs_name_exist():
    """Docs name policy keys by path (`store.on_failure`, `classes.<name>.max_wait_ms`, `tenants[].max_class`), or
    by the tail of one (`fairness.mode`, `limit.borrow_lower`): each must be a key path of the schema (as
    docs/configuration.md lists them), a `<placeholder>` or a name standing for any name of a mapping."""
    rows = [p.split(".") for p in re.findall(r"^\| `([^`]+)` \|", docsgen.render(), re.M)]
    parents = {s for p in rows for s in p[:-1]} - {"<name>"}

    def matches(schema: list[str], said: list[str]) -> bool:
        return all(s == d or (s == "<name>" and re.fullmatch(r"<\w+>|[\w-]+", d)) for s, d in zip(schema, said))

    def known(said: list[str]) -> bool:
        return any(matches(p[i:i + len(said)], said) for p in rows for i in range(len(p) - len(said) + 1))

    not_policy = {("demo.md", "pools.<name>.scheduling_policy")}  # a demo scenario's pool key, not the policy's
    named, unknown = 0, []
    for page, text in doc_pages():
        for code in re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S)):
            m = re.fullmatch(r"([a-z_]+(?:\[\])?(?:\.(?:<\w+>|[A-Za-z_][\w-]*)(?:\[\])?)+)(?::\s.*)?", code)
            # A path starts at a key with keys under it (`cluster.x.y` is an Envoy stat); files are not paths.
            if not m or m.group(1).split(".")[0] not in parents or re.search(r"\.(py|ya?ml|md|json)$", m.group(1)):
                continue
            named += 1
            if not known(m.group(1).split(".")) and (page, m.group(1)) not in not_policy:
                unknown.append((page, m.group(1)))
    assert named > 100  # the scan finds them (about 240 today, most in configuration.md)
    assert not unknown, unknown
