"""The names a pool's replicas serve for a policy model, read from their `/v1/models`
(`models.<name>.names_from_replicas`).

vLLM lists a replica's served names (`--served-model-name`: cards without a `parent`, all of them the one model the
process runs) and then its LoRA adapters (cards whose `parent` is the base model's name), those given at start-up
and those loaded at runtime alike. A replica of pool P whose served names include a name of model M (M routed to
P, with names_from_replicas on) serves every name it lists for M: its other served names and the adapters whose
parent is one of them. Those names are admitted as M (M's cost model, M's metric labels), so a client reaches only
a pool that the policy routes its model to and never adds a label; a name two pools serve is left out, a name the
policy itself names keeps the policy's model.

The same listings give a model whose policy sets no `cost.max_context_tokens` its context length: the largest
`max_model_len` its replicas list for it (context_lengths).
"""

from __future__ import annotations

from typing import Any

MAX_NAMES_PER_POOL = 10_000  # a listing longer than any real fleet's is cut here: memory stays bounded
MAX_CONTEXT_TOKENS = 16 * 1024 * 1024  # a listed max_model_len past any real model's says nothing: not learned


def replica_names(cards: Any, known: dict[str, str]) -> dict[str, str]:
    """One replica's `/v1/models` `data` -> each name it serves -> the policy model it is, given `known` (the
    names the policy admits for this pool, with names_from_replicas on -> their model). Empty when its served names
    include none of them, or when the listing is not vLLM's shape."""
    if not isinstance(cards, list):
        return {}
    ids = [(c.get("id"), c.get("parent")) for c in cards if isinstance(c, dict)]
    bases = [i for i, parent in ids if isinstance(i, str) and parent is None]
    model = next((known[b] for b in bases if b in known), None)
    if model is None:
        return {}
    served = dict.fromkeys(bases, model)
    # A parent that is not a string (a list from a misbehaving replica) names no base, and would not hash.
    served.update((i, model) for i, parent in ids
                  if isinstance(i, str) and isinstance(parent, str) and parent in served)
    return served


def pool_names(listings: list[Any], known: dict[str, str]) -> dict[str, str]:
    """What a pool serves: the union of its replicas' names (a runtime adapter is loaded one replica at a time:
    admitted once the first has it), at most MAX_NAMES_PER_POOL."""
    names: dict[str, str] = {}
    for cards in listings:
        for name, model in replica_names(cards, known).items():
            if len(names) >= MAX_NAMES_PER_POOL:
                return names
            names.setdefault(name, model)
    return names


def merge(pools: dict[str, dict[str, str]], static: dict[str, str]) -> dict[str, str]:
    """Every pool's names in one map, less those the policy names itself (its mapping wins) and those two pools
    serve (which pool a client meant is not known: it gets 404, as before)."""
    merged: dict[str, str] = {}
    twice: set[str] = set()
    for names in pools.values():
        for name, model in names.items():
            if name in merged and merged[name] != model:
                twice.add(name)
            merged[name] = model
    return {name: model for name, model in merged.items() if name not in static and name not in twice}


def context_lengths(listings: list[Any], names: dict[str, str]) -> dict[str, int]:
    """A pool's replicas' `/v1/models` `data` -> each model that `names` (a card's id -> its model) finds there
    -> the largest `max_model_len` they list for it: a request may run that far on the replica that lists it, so
    an estimate clamped there stays on the safe side, and one replica started with a small `--max-model-len` by
    mistake does not shrink every estimate of the pool (a pool limit in tokens would then take each request as
    its prompt and one token). An adapter's card counts as its parent's in the same listing (vLLM gives an
    adapter none). A model with no usable length listed is left out."""
    learned: dict[str, int] = {}
    for cards in listings:
        if not isinstance(cards, list):
            continue
        by_id = {c["id"]: c for c in cards if isinstance(c, dict) and isinstance(c.get("id"), str)}
        for name, c in by_id.items():
            model = names.get(name)
            if model is None:
                continue
            parent = c.get("parent")
            length = _length(by_id.get(parent) if isinstance(parent, str) else c)
            if length is not None:
                learned[model] = max(length, learned.get(model, length))
    return learned


def _length(card: Any) -> int | None:
    """A card's max_model_len if it is one a model could have (an int, not a bool, within bounds)."""
    length = card.get("max_model_len") if isinstance(card, dict) else None
    return length if type(length) is int and 1 <= length <= MAX_CONTEXT_TOKENS else None


def catalog(models: dict[str, Any], listings: dict[str, list], served_names: dict[str, str],
            contexts: dict[str, int | None]) -> dict[str, dict]:
    """Every name the edge admits -> its `/v1/models` card's fields (`owned_by`, `root`, `parent`,
    `max_model_len`): in the policy's order, each model's key, then its aliases, then the names its replicas add,
    each once. A name a replica of its model's pool lists keeps that replica's fields; any other (its pool's
    listings are not read, or not yet) gets what the policy knows: `root` its model's key, no `parent`, and the
    model's context in `contexts` (its `cost.max_context_tokens`, else the one its replicas list)."""
    added: dict[str, list[str]] = {}
    for name, model in served_names.items():
        added.setdefault(model, []).append(name)
    seen: dict[str, dict[str, dict]] = {}  # cluster -> the first card its replicas give for each name
    cards: dict[str, dict] = {}
    for key, m in models.items():
        if m.cluster not in seen:
            seen[m.cluster] = {}
            for listing in listings.get(m.cluster) or ():
                for c in listing if isinstance(listing, list) else ():
                    if isinstance(c, dict) and isinstance(c.get("id"), str):
                        seen[m.cluster].setdefault(c["id"], c)
        known = seen[m.cluster]
        for name in (key, *m.aliases, *added.get(key, ())):
            if name in cards:
                continue
            c = known.get(name)
            if c is None:
                cards[name] = {"owned_by": "vllm", "root": key, "parent": None,
                               "max_model_len": contexts.get(key)}
                continue
            cards[name] = {"owned_by": _text(c.get("owned_by"), "vllm"), "root": _text(c.get("root"), key),
                           "parent": _text(c.get("parent"), None),
                           "max_model_len": c["max_model_len"] if type(c.get("max_model_len")) is int else None}
    return cards


def _text(value: Any, default: str | None) -> str | None:
    return value[:1024] if isinstance(value, str) else default
