"""Token-level radix tree of KV segments: the CPU engine's prefix cache.

What it does: stores, per namespace (an adapter's load id, or "base"), the key/value tensors
of token sequences the engine has already run, so a new request reuses the longest cached
prefix of its prompt and only prefills the rest. Like SGLang's RadixCache:

* a node's edge holds a run of token ids and the KV of exactly those tokens; a partial match
  splits the node so every match ends on a node boundary;
* nodes in use are pinned with `lock` / `unlock` (a lock pins the node and all its ancestors);
* when the stored tokens exceed the budget, unpinned leaves are evicted, least recently used
  first;
* namespaces never share entries: the same prompt under adapter A and under the base model are
  two different sequences, and a reloaded adapter (new load id) starts from an empty namespace.

What it deliberately does not do: know anything about models, layers or HTTP. A stored value is
any tensor whose `token_dim` axis runs over the tokens (the engine uses (layers, 2, heads,
tokens, head_dim)); this module only slices and concatenates it along that axis. No paging, no
host/disk tiers, no thread safety: one owner (the engine's scheduler thread) calls it.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import torch

BASE_NAMESPACE = "base"


@dataclass(eq=False)
class Node:
    """One edge of the tree: `tokens` and their KV, hanging below `parent`."""

    tokens: tuple[int, ...]
    kv: torch.Tensor | None  # None only for namespace roots
    parent: Node | None
    namespace: str
    children: dict[int, Node] = field(default_factory=dict)  # keyed by the child's first token
    lock_ref: int = 0
    last_access: int = 0

    @property
    def is_root(self) -> bool:
        return self.parent is None


@dataclass
class PrefixMatch:
    """The longest cached prefix of a query: `length` tokens along `nodes` (root excluded)."""

    length: int
    nodes: list[Node]
    token_dim: int

    @property
    def last_node(self) -> Node | None:
        return self.nodes[-1] if self.nodes else None

    def kv(self) -> torch.Tensor | None:
        """The matched prefix's KV, concatenated along the token axis (None when empty)."""
        if not self.nodes:
            return None
        if len(self.nodes) == 1:
            return self.nodes[0].kv  # callers only read it
        return torch.cat([n.kv for n in self.nodes], dim=self.token_dim)


class RadixCache:
    """Prefix cache of KV segments keyed by token sequences, one tree per namespace."""

    def __init__(self, budget_tokens: int, token_dim: int = -2):
        assert budget_tokens >= 0, f"budget_tokens must be >= 0, got {budget_tokens}"
        self.budget_tokens = budget_tokens
        self.token_dim = token_dim
        self._roots: dict[str, Node] = {}
        self._clock = itertools.count(1)
        self.total_tokens = 0

    # ---- queries -------------------------------------------------------------------------
    def match_prefix(self, namespace: str, tokens: list[int]) -> PrefixMatch:
        """Longest cached prefix of `tokens` in `namespace`; touches the path (LRU)."""
        root = self._roots.get(namespace)
        nodes: list[Node] = []
        length = 0
        node = root
        now = next(self._clock)
        while node is not None and length < len(tokens):
            child = node.children.get(tokens[length])
            if child is None:
                break
            common = _common_length(child.tokens, tokens, length)
            if common < len(child.tokens):
                child = self._split(child, common)
            child.last_access = now
            nodes.append(child)
            length += common
            node = child
        return PrefixMatch(length=length, nodes=nodes, token_dim=self.token_dim)

    @property
    def namespaces(self) -> list[str]:
        return list(self._roots)

    @property
    def evictable_tokens(self) -> int:
        return sum(len(n.tokens) for n in self._all_nodes() if n.lock_ref == 0)

    def num_nodes(self) -> int:
        return sum(1 for _ in self._all_nodes())

    # ---- updates -------------------------------------------------------------------------
    def insert(self, namespace: str, tokens: list[int], kv: torch.Tensor) -> Node | None:
        """Cache `tokens` whose KV is `kv` (same length along the token axis).

        Only the part not already cached is copied in. Returns the node that ends the
        sequence (lock it to pin the whole path), or None for an empty sequence. May evict
        other, unpinned, entries to stay within the budget.
        """
        n_kv = kv.shape[self.token_dim]
        assert n_kv == len(tokens), f"kv has {n_kv} tokens along dim {self.token_dim}, tokens {len(tokens)}"
        if not tokens:
            return None
        match = self.match_prefix(namespace, tokens)
        parent = match.last_node or self._root(namespace)
        end = parent
        if match.length < len(tokens):
            rest = kv.narrow(self.token_dim, match.length, len(tokens) - match.length).clone()
            end = Node(tokens=tuple(tokens[match.length:]), kv=rest, parent=parent,
                       namespace=namespace, last_access=next(self._clock))
            parent.children[end.tokens[0]] = end
            self.total_tokens += len(end.tokens)
        # Pin the new path while evicting so the sequence just inserted survives if it can.
        self.lock(end)
        self.evict(self.total_tokens - self.budget_tokens)
        self.unlock(end)
        return end

    def lock(self, node: Node | None) -> None:
        """Pin `node` and its ancestors against eviction (reference counted)."""
        while node is not None and not node.is_root:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node | None) -> None:
        while node is not None and not node.is_root:
            assert node.lock_ref > 0, "unlock without a matching lock"
            node.lock_ref -= 1
            node = node.parent

    def evict(self, num_tokens: float, namespace: str | None = None) -> int:
        """Evict unpinned leaves, least recently used first, until `num_tokens` are freed.

        With `namespace`, only that namespace's entries are candidates.
        """
        if num_tokens <= 0:
            return 0
        heap = [(n.last_access, id(n), n) for n in self._all_nodes(namespace) if self._evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_tokens:
            _, _, leaf = heapq.heappop(heap)
            freed += self._remove_leaf(leaf)
            parent = leaf.parent
            if self._evictable(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def drop_namespace(self, namespace: str) -> int:
        """Forget a namespace (its adapter was unloaded); pinned entries stay until evicted later."""
        return self.evict(float("inf"), namespace=namespace)

    def reset(self) -> None:
        """Drop everything (the engine's /flush_cache, only called when nothing is running)."""
        self._roots.clear()
        self.total_tokens = 0

    # ---- internals -----------------------------------------------------------------------
    def _root(self, namespace: str) -> Node:
        root = self._roots.get(namespace)
        if root is None:
            root = Node(tokens=(), kv=None, parent=None, namespace=namespace)
            self._roots[namespace] = root
        return root

    def _split(self, node: Node, at: int) -> Node:
        """Split `node` after `at` tokens; return the new upper half (which keeps the locks)."""
        upper = Node(tokens=node.tokens[:at], kv=node.kv.narrow(self.token_dim, 0, at).clone(),
                     parent=node.parent, namespace=node.namespace, lock_ref=node.lock_ref,
                     last_access=node.last_access)
        rest = len(node.tokens) - at
        node.kv = node.kv.narrow(self.token_dim, at, rest).clone()
        node.tokens = node.tokens[at:]
        node.parent.children[upper.tokens[0]] = upper
        node.parent = upper
        upper.children[node.tokens[0]] = node
        return upper

    def _evictable(self, node: Node) -> bool:
        return not node.is_root and not node.children and node.lock_ref == 0

    def _remove_leaf(self, node: Node) -> int:
        del node.parent.children[node.tokens[0]]
        self.total_tokens -= len(node.tokens)
        parent = node.parent
        if parent.is_root and not parent.children:
            self._roots.pop(parent.namespace, None)
        return len(node.tokens)

    def _all_nodes(self, namespace: str | None = None):
        roots = self._roots.values() if namespace is None else [self._roots.get(namespace)]
        stack = [c for r in roots if r is not None for c in r.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def _common_length(edge: tuple[int, ...], tokens: list[int], start: int) -> int:
    n = min(len(edge), len(tokens) - start)
    if edge[:n] == tuple(tokens[start:start + n]):  # the common case, compared in C
        return n
    i = 0
    while i < n and edge[i] == tokens[start + i]:
        i += 1
    return i
