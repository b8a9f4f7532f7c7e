"""Request facts -> traffic class (the claimed class capped by what the tenant may use) and fairness key."""

from __future__ import annotations

from dataclasses import dataclass

from .fairness import SEP, nested
from .schema import Policy

ANONYMOUS = "anonymous"
MAX_FAIRNESS_KEY = 128  # characters kept of a fairness key read from a header


@dataclass(frozen=True, slots=True)
class Classification:
    cls: str
    tenant: str            # tenant name from config, or "anonymous": safe as a metric label
    demoted: bool = False  # claimed a class above the tenant's max_class
    unknown: bool = False  # claimed a class name the policy does not define
    fairness_key: str = ""  # the flow it counts against inside its class ("": the tenant)
    keyed: bool = False    # it presented an API key, known or not (a refusal for its key says which it lacks)

    @property
    def flow(self) -> str:
        """A header's key counts inside its tenant (fairness.nested): it splits the tenant's share, and a key that
        names another tenant does not reach that tenant's flow."""
        return nested(self.tenant, self.fairness_key) if self.fairness_key else self.tenant


@dataclass(frozen=True, slots=True)
class _TenantLimits:
    name: str
    max_rank: int
    default_class: str
    max_body_bytes: int | None = None


class Classifier:
    """Tenant (by API key) first, then the claim: the class header, then the objective header (mapped through
    `classify.objectives`), then the body field, then the tenant's default. The fairness key is the tenant, or
    the fairness header's value where the policy names one."""

    def __init__(self, policy: Policy):
        names = policy.class_names()
        self._rank = {n: i for i, n in enumerate(names)}
        self._names = names
        self._by_key: dict[str, _TenantLimits] = {}
        for t in policy.tenants:
            limits = self._limits(t.name, t.max_class, t.default_class, policy, t.max_body_bytes)
            for key in t.api_keys:
                self._by_key[key] = limits
        a = policy.anonymous
        # Anonymous defaults to the lowest class: a key dropped, mangled or put where we do not read it must
        # never be worth more than a real one.
        self._anonymous = self._limits(ANONYMOUS, a.max_class or names[-1], a.default_class, policy,
                                       a.max_body_bytes)
        self.tenant_names = [t.name for t in policy.tenants] + [ANONYMOUS]
        self._objectives = dict(policy.classify.objectives)
        self._reads_fairness = policy.classify.fairness_header is not None

    def _limits(self, name: str, max_class: str | None, default: str | None, policy: Policy,
                max_body_bytes: int | None = None) -> _TenantLimits:
        max_rank = self._rank[max_class] if max_class else 0
        default = default or policy.fallback_class()
        # A default above the cap (only possible through the global default) is capped too.
        if self._rank[default] < max_rank:
            default = self._names[max_rank]
        return _TenantLimits(name, max_rank, default, max_body_bytes)

    def knows(self, api_key: str | None) -> bool:
        return api_key is not None and api_key in self._by_key

    def tenant_for(self, api_key: str | None) -> _TenantLimits:
        return self._by_key.get(api_key, self._anonymous) if api_key else self._anonymous

    def classify(self, api_key: str | None, header_claim: str | None, body_claim: str | None,
                 objective: str | None = None, fairness_id: str | None = None) -> Classification:
        """`objective` and `fairness_id` are the values of the policy's `objective_header` and `fairness_header`
        (None when absent or not configured)."""
        tenant = self.tenant_for(api_key)
        key, keyed = self._fairness_key(fairness_id), api_key is not None
        if objective:
            name = objective.lower()  # like the other claims: class and objective names are lower case
            objective = self._objectives.get(name, name)
        claim = header_claim or objective or body_claim
        if not claim:
            return Classification(tenant.default_class, tenant.name, fairness_key=key, keyed=keyed)
        rank = self._rank.get(claim)
        if rank is None:
            return Classification(tenant.default_class, tenant.name, unknown=True, fairness_key=key, keyed=keyed)
        if rank < tenant.max_rank:
            return Classification(self._names[tenant.max_rank], tenant.name, demoted=True, fairness_key=key,
                                  keyed=keyed)
        return Classification(claim, tenant.name, fairness_key=key, keyed=keyed)

    def _fairness_key(self, fairness_id: str | None) -> str:
        if not self._reads_fairness or not fairness_id:
            return ""
        return fairness_id.replace(SEP, "").strip()[:MAX_FAIRNESS_KEY]


class ConflictingKeys(ValueError):
    """A request presents two different API keys: which one is meant cannot be told, so it is refused."""


def bearer_key(authorization: str | None) -> str | None:
    """The key of an "Authorization: Bearer <key>" header, else None."""
    if not authorization or len(authorization) < 8 or authorization[:7].lower() != "bearer ":
        return None
    return authorization[7:].strip() or None


def presented_key(authorization: list[str], api_key: list[str]) -> str | None:
    """The one API key a request presents, from `Authorization: Bearer <key>` (OpenAI) or `api-key: <key>`
    (Azure OpenAI). Other Authorization schemes (Basic, ...) present no key. Repeated headers (Envoy joins them
    with a comma; keys never contain one) may repeat the same key; two different keys raise ConflictingKeys."""
    keys = set()
    for value in authorization:
        for part in value.split(","):
            key = bearer_key(part.strip())
            if key:
                keys.add(key)
    for value in api_key:
        for part in value.split(","):
            if part.strip():
                keys.add(part.strip())
    if len(keys) > 1:
        raise ConflictingKeys("the request presents more than one API key")
    return next(iter(keys), None)
