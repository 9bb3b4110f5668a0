"""Routing: the key (the whole rendered conversation, in chained blocks), the ``prefix`` policy's two
states, thresholds and spill, ``prefix-hash``'s ring with bounded loads, and the ``least-loaded`` rule."""

from __future__ import annotations

import hashlib

import attrs
import pytest

from apsd.core.config import ConfigError, RoutingConfig, parse_config
from apsd.core.models import InferenceRequest
from apsd.core.routing import BLOCK_CHARS, BLOCK_TOKENS, Target, chain_blocks, render_conversation, routing_key
from apsd.plugins import build_policies
from apsd.policies.routing import LeastLoaded, PrefixHashRouting, PrefixRouting

SYSTEM = "You are a careful assistant. " * 40   # about 1,160 characters: several blocks


def chat(*messages: tuple[str, str], model: str = "m", **extra) -> InferenceRequest:
    payload = {"model": model, "messages": [{"role": r, "content": c} for r, c in messages], **extra}
    return InferenceRequest(request_id="r", tenant_id="t", prompt_tokens=100, tokens_requested=10, priority_bid=5,
                            model=model, api="chat.completions", payload=payload)


def target(name: str, load: int = 0, capacity: int = 8, room: bool = True, cache_tokens: int = 10**6) -> Target:
    return Target(name=name, load=load, capacity=capacity, room=room, cache_tokens=cache_tokens)


def shared_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# -- the key -----------------------------------------------------------------------------------------

def test_a_next_turn_extends_the_key_of_the_turn_before():
    first = routing_key(chat(("system", SYSTEM), ("user", "What is a prefix cache?")))
    second = routing_key(chat(("system", SYSTEM), ("user", "What is a prefix cache?"),
                              ("assistant", "It keeps the KV of prompts it has read. " * 10), ("user", "And then?")))
    whole = len(render_conversation("m", {"messages": [{"role": "system", "content": SYSTEM},
                                                       {"role": "user", "content": "What is a prefix cache?"}]}, ""))
    assert len(second) > len(first) >= 5
    # every whole block of the first turn is the start of the second's key (its partial last block is not)
    assert second[:whole // BLOCK_CHARS] == first[:whole // BLOCK_CHARS]


def test_conversations_differing_only_in_a_late_message_part_at_that_block_and_after():
    early = [("system", SYSTEM), ("user", "Summarise the report."), ("assistant", "The report says many things. " * 12)]
    a = routing_key(chat(*early, ("user", "Now in French.")))
    b = routing_key(chat(*early, ("user", "Now in German.")))
    common = shared_prefix(a, b)
    assert common >= 6                              # the shared conversation keeps its blocks ...
    assert a[common:] and b[common:]                # ... and they part from the block of the late message on
    assert all(x != y for x, y in zip(a[common:], b[common:]))   # (chained: never the same again)


def test_tools_model_and_roles_are_part_of_the_key():
    base = routing_key(chat(("system", SYSTEM), ("user", "hi")))
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    with_tools = routing_key(chat(("system", SYSTEM), ("user", "hi"), tools=[tool]))
    other_tool = routing_key(chat(("system", SYSTEM), ("user", "hi"),
                                  tools=[{**tool, "function": {**tool["function"], "name": "get_time"}}]))
    other_model = routing_key(chat(("system", SYSTEM), ("user", "hi"), model="m2"))
    other_role = routing_key(chat(("user", SYSTEM), ("user", "hi")))
    for key in (with_tools, other_tool, other_model, other_role):
        assert key[0] != base[0]                    # different from the first block: nothing shared
    assert with_tools[0] != other_tool[0]


def test_the_same_conversation_has_the_same_key_in_any_process():
    request = chat(("system", SYSTEM), ("user", "hi"))
    key = routing_key(request)
    assert key == chain_blocks(render_conversation("m", request.payload, ""))
    assert routing_key(chat(("system", SYSTEM), ("user", "hi"))) == key
    text = render_conversation("m", request.payload, "").encode()
    # BLAKE2b of the first block (no per-process salt, as Python's hash() has): what any replica computes
    assert key[0] == int.from_bytes(hashlib.blake2b(text[:BLOCK_CHARS], digest_size=8).digest(), "big")
    assert routing_key(InferenceRequest(request_id="r", tenant_id="t", prompt_tokens=1, tokens_requested=1,
                                        priority_bid=5)) == ()  # no text: no key


# -- prefix: the two states and their thresholds ----------------------------------------------------

def settings(**changes) -> RoutingConfig:
    return attrs.evolve(RoutingConfig(), **changes)


def warm(policy: PrefixRouting, name: str, request: InferenceRequest) -> None:
    policy.placed(request, target(name))


@pytest.mark.parametrize(("high", "expected"), [(4, "cache_match"), (5, "imbalance"), (3, "cache_match")])
def test_balance_abs_at_just_under_and_just_over(high, expected):
    # capacity 8: fills 0/8 ... ; balance_abs 0.5 = 4 slots; rel 1.0 so only abs decides
    policy = PrefixRouting(settings(balance_abs=0.5, balance_rel=1.0))
    request = chat(("system", SYSTEM), ("user", "hi"))
    warm(policy, "a", request)
    route = policy.route(request, [target("a", load=high), target("b", load=0)])
    assert route.reason == expected
    assert route.index == (0 if expected == "cache_match" else 1)


@pytest.mark.parametrize(("high", "expected"), [(6, "cache_match"), (7, "imbalance"), (5, "cache_match")])
def test_balance_rel_at_just_under_and_just_over(high, expected):
    # fills high/8 against 3/8 (at rel 2: imbalanced only above 6/8); abs 0 so only rel decides
    policy = PrefixRouting(settings(balance_abs=0.0, balance_rel=2.0))
    request = chat(("system", SYSTEM), ("user", "hi"))
    warm(policy, "a", request)
    route = policy.route(request, [target("a", load=high), target("b", load=3)])
    assert route.reason == expected


def key_of_blocks(n: int) -> InferenceRequest:
    request = chat(("user", "x"))
    request.prefix_blocks = tuple(range(1000, 1000 + n))
    return request


@pytest.mark.parametrize(("held", "expected"), [(5, "cache_match"), (4, "no_match"), (6, "cache_match")])
def test_cache_threshold_at_just_under_and_just_over(held, expected):
    policy = PrefixRouting(settings(cache_threshold=0.5))
    known = key_of_blocks(held)
    warm(policy, "a", known)
    request = key_of_blocks(10)                     # its first `held` blocks are on "a": held/10 of the key
    route = policy.route(request, [target("a", load=1), target("b", load=0)])
    assert route.reason == expected
    assert route.index == (0 if expected == "cache_match" else 1)   # no match: the least loaded


def test_the_longest_match_wins_and_ties_go_to_the_least_loaded():
    policy = PrefixRouting(settings())
    warm(policy, "a", key_of_blocks(4))
    warm(policy, "b", key_of_blocks(8))
    warm(policy, "c", key_of_blocks(8))
    route = policy.route(key_of_blocks(10), [target("a"), target("b", load=2), target("c", load=1)])
    assert (route.index, route.reason) == (2, "cache_match")


def test_a_full_target_spills_to_the_longest_match_with_room():
    policy = PrefixRouting(settings())
    warm(policy, "a", key_of_blocks(10))
    warm(policy, "b", key_of_blocks(3))
    route = policy.route(key_of_blocks(10), [target("a", load=2, room=False), target("b", load=3), target("c", load=2)])
    assert (route.index, route.reason) == (1, "spill")
    # nobody has room: the policy's own choice stands (the engine then waits for room)
    route = policy.route(key_of_blocks(10), [target("a", load=2, room=False), target("b", room=False)])
    assert (route.index, route.reason) == (0, "cache_match")


def test_the_picture_keeps_what_the_cache_holds_and_a_keys_start_longest():
    policy = PrefixRouting(settings())
    small = target("a", cache_tokens=6 * BLOCK_TOKENS)   # six blocks
    first = key_of_blocks(4)
    policy.placed(first, small)
    other = chat(("user", "y"))
    other.prefix_blocks = (7, 8, 9, 10)
    policy.placed(other, small)                      # 8 blocks into 6: two of `first`'s go, its tail first
    assert policy.match("a", first.prefix_blocks) == 2
    assert policy.match("a", other.prefix_blocks) == 4


# -- prefix-hash -----------------------------------------------------------------------------------

def test_prefix_hash_gives_every_replica_the_same_answer_and_spreads_keys():
    one, two = PrefixHashRouting(settings()), PrefixHashRouting(settings())
    targets = [target(name) for name in ("a", "b", "c", "d")]
    homes = []
    for n in range(200):
        request = key_of_blocks(3)
        request.prefix_blocks = (n, n + 1, n + 2)
        first, second = one.route(request, targets), two.route(request, targets)
        assert first == second and first.reason == "hash"
        homes.append(first.index)
    assert all(homes.count(i) > 20 for i in range(4))   # 200 keys over 4 targets: none starved


def test_prefix_hash_hashes_only_the_conversations_start_and_bounds_loads():
    policy = PrefixHashRouting(settings(hash_blocks=1, load_factor=1.25))
    targets = [target(name) for name in ("a", "b", "c")]
    request = key_of_blocks(5)
    home = policy.route(request, targets).index
    longer = key_of_blocks(9)                       # same first block: same home
    assert policy.route(longer, targets).index == home
    # load_factor 1.5, the others at 1: the bound is 1.5 x (mean + 1) = (home + 5) / 2, so the home takes it
    # up to a load of 5 (at its bound) and not at 6
    policy = PrefixHashRouting(settings(hash_blocks=1, load_factor=1.5))
    for load, taken in ((4, True), (5, True), (6, False)):
        loads = [1, 1, 1]
        loads[home] = load
        route = policy.route(request, [attrs.evolve(t, load=n) for t, n in zip(targets, loads)])
        assert (route.index == home, route.reason) == ((True, "hash") if taken else (False, "hash_spill"))


def test_least_loaded_takes_the_smallest_share_of_slots_with_room():
    policy = LeastLoaded()
    request = key_of_blocks(1)
    targets = [target("a", load=2, capacity=4), target("b", load=3, capacity=8), target("c", load=0, room=False)]
    assert policy.route(request, targets).index == 1
    assert policy.route(request, targets).reason == "least_loaded"


# -- configuration ----------------------------------------------------------------------------------

def test_routing_policy_is_configured_and_an_unknown_one_is_named():
    config = parse_config({"routing": {"policy": "prefix-hash", "load_factor": 2}})
    assert build_policies(config).routing.name == "prefix-hash"
    assert build_policies(parse_config({})).routing.name == "prefix"
    with pytest.raises(ConfigError, match=r"routing.policy: unknown routing policy 'nearest'.*least-loaded"):
        build_policies(parse_config({"routing": {"policy": "nearest"}}))
    with pytest.raises(ConfigError, match=r"routing.balance_rel"):
        parse_config({"routing": {"balance_rel": 0.5}})


@pytest.mark.parametrize("selected", ["prefix", "prefix-hash"])
def test_a_policy_table_of_a_routing_policy_is_checked_by_it_not_a_crash(selected):
    # ([policy.<name>] of a routing policy raised KeyError: 'routing' while the tables were checked for typos)
    empty = parse_config({"routing": {"policy": selected}, "policy": {"prefix-hash": {}, "least-loaded": {}}})
    assert build_policies(empty).routing.name == selected
    with pytest.raises(ConfigError, match=r"policy.prefix-hash: the built-in routing policies take their settings "
                                          r"from \[routing\] \(got x\)"):
        build_policies(parse_config({"routing": {"policy": selected}, "policy": {"prefix-hash": {"x": 1}}}))
