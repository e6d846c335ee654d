"""Unit tests of the token-level radix tree (artsg_nb/cpu_engine/radix_cache.py), on hand-made tensors.

A stored value is a (tokens, 1) tensor whose entries equal the token ids, so every slice and
concatenation the tree does can be checked against the tokens themselves.
"""

import torch

from artsg_nb.cpu_engine.radix_cache import RadixCache


def kv(tokens):
    return torch.tensor(tokens, dtype=torch.float32)[:, None]  # token axis -2


def test_insert_then_match_returns_the_stored_kv():
    cache = RadixCache(budget_tokens=100)
    cache.insert("base", [1, 2, 3, 4], kv([1, 2, 3, 4]))
    m = cache.match_prefix("base", [1, 2, 3, 4, 5])
    assert m.length == 4
    assert m.kv()[:, 0].tolist() == [1, 2, 3, 4]
    assert cache.match_prefix("base", [9]).length == 0 and cache.match_prefix("base", [9]).kv() is None


def test_partial_match_splits_the_node():
    cache = RadixCache(budget_tokens=100)
    cache.insert("base", [1, 2, 3, 4], kv([1, 2, 3, 4]))
    m = cache.match_prefix("base", [1, 2, 7])
    assert m.length == 2 and m.kv()[:, 0].tolist() == [1, 2]
    assert cache.num_nodes() == 2 and cache.total_tokens == 4
    cache.insert("base", [1, 2, 7, 8], kv([1, 2, 7, 8]))  # branch: only [7, 8] is new
    assert cache.total_tokens == 6 and cache.num_nodes() == 3
    assert cache.match_prefix("base", [1, 2, 3, 4]).kv()[:, 0].tolist() == [1, 2, 3, 4]
    assert cache.match_prefix("base", [1, 2, 7, 8]).kv()[:, 0].tolist() == [1, 2, 7, 8]


def test_inserting_a_cached_sequence_copies_nothing():
    cache = RadixCache(budget_tokens=100)
    end = cache.insert("base", [1, 2, 3], kv([1, 2, 3]))
    assert cache.insert("base", [1, 2, 3], kv([1, 2, 3])) is end
    assert cache.insert("base", [1, 2], kv([1, 2])).tokens == (1, 2)  # split, still 3 tokens
    assert cache.total_tokens == 3


def test_namespaces_never_share_entries():
    cache = RadixCache(budget_tokens=100)
    cache.insert("adapter-load-1", [1, 2, 3], kv([1, 2, 3]))
    assert cache.match_prefix("base", [1, 2, 3]).length == 0
    assert cache.match_prefix("adapter-load-2", [1, 2, 3]).length == 0
    assert cache.match_prefix("adapter-load-1", [1, 2, 3]).length == 3
    assert cache.drop_namespace("adapter-load-1") == 3
    assert cache.namespaces == [] and cache.total_tokens == 0


def test_lru_eviction_keeps_the_budget_and_the_recent_entries():
    cache = RadixCache(budget_tokens=6)
    cache.insert("base", [1, 2, 3], kv([1, 2, 3]))
    cache.insert("base", [4, 5, 6], kv([4, 5, 6]))
    cache.match_prefix("base", [1, 2, 3])  # touch: [4, 5, 6] is now least recent
    cache.insert("base", [7, 8], kv([7, 8]))
    assert cache.total_tokens <= 6
    assert cache.match_prefix("base", [1, 2, 3]).length == 3
    assert cache.match_prefix("base", [7, 8]).length == 2
    assert cache.match_prefix("base", [4, 5, 6]).length == 0


def test_eviction_removes_leaves_before_their_parents():
    cache = RadixCache(budget_tokens=100)
    cache.insert("base", [1, 2, 3, 4], kv([1, 2, 3, 4]))
    cache.insert("base", [1, 2, 5, 6], kv([1, 2, 5, 6]))  # [1,2] shared by two leaves
    assert cache.evict(1) == 2  # one whole leaf (the oldest: [3, 4])
    assert cache.match_prefix("base", [1, 2, 5, 6]).length == 4
    assert cache.match_prefix("base", [1, 2, 3, 4]).length == 2
    assert cache.evict(100) == 4 and cache.total_tokens == 0 and cache.namespaces == []


def test_locked_nodes_survive_eviction_until_unlocked():
    cache = RadixCache(budget_tokens=100)
    node = cache.insert("base", [1, 2, 3], kv([1, 2, 3]))
    cache.lock(node)
    cache.insert("base", [9, 9], kv([9, 9]))
    assert cache.evict(100) == 2  # only the unlocked entry goes
    assert cache.match_prefix("base", [1, 2, 3]).length == 3
    assert cache.evictable_tokens == 0
    cache.unlock(node)
    assert cache.evictable_tokens == 3 and cache.evict(100) == 3


def test_a_lock_survives_a_split_of_the_locked_path():
    cache = RadixCache(budget_tokens=100)
    node = cache.insert("base", [1, 2, 3, 4], kv([1, 2, 3, 4]))
    cache.lock(node)
    cache.match_prefix("base", [1, 2, 9])  # splits the locked node into [1, 2] + [3, 4]
    assert cache.evict(100) == 0
    cache.unlock(node)
    assert cache.evict(100) == 4


def test_insert_over_budget_evicts_older_entries_first():
    cache = RadixCache(budget_tokens=4)
    cache.insert("base", [1, 2], kv([1, 2]))
    cache.insert("base", [3, 4, 5, 6], kv([3, 4, 5, 6]))
    assert cache.total_tokens == 4
    assert cache.match_prefix("base", [3, 4, 5, 6]).length == 4
    assert cache.match_prefix("base", [1, 2]).length == 0


def test_reset_forgets_everything():
    cache = RadixCache(budget_tokens=100)
    cache.insert("base", [1, 2], kv([1, 2]))
    cache.insert("a", [1, 2], kv([1, 2]))
    cache.reset()
    assert cache.total_tokens == 0 and cache.match_prefix("base", [1, 2]).length == 0


def test_multilayer_kv_is_sliced_along_the_token_axis():
    # The engine's layout: (layers, 2, heads, tokens, head_dim).
    cache = RadixCache(budget_tokens=100, token_dim=3)
    full = torch.randn(2, 2, 3, 5, 4)
    cache.insert("base", [1, 2, 3, 4, 5], full)
    cache.match_prefix("base", [1, 2, 3, 0])  # split after 3 tokens
    m = cache.match_prefix("base", [1, 2, 3, 4, 5])
    assert m.length == 5 and len(m.nodes) == 2
    assert torch.equal(m.kv(), full)
