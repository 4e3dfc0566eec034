"""Exact grammar masks cached by token history: rows that consumed the same tokens share one fill.

Why: a matcher's state is a function of its compiled grammar and the tokens it consumed from the initial
state, and its mask a function of that state. Every request of one schema starts in the same state and the
schema's forced text (`{"label": "`, the key names, separators) keeps many of them on the same token
histories for their first tokens; at a 128k vocabulary those early masks are also the dearest (up to
~2 ms a row: the lexer has to decide on every token). Filling each once and copying the bytes to the
other rows removes those fills; the copy is bitwise what llguidance would compute for the row.

The cache is a trie per compiled grammar (keyed by `GrammarSpec.key`): a node per (parent, token) that a
live request reached. A request holds the node of its history (`GrammarState.node`) and moves it on each
accepted token (`step`); a rejected token (the matcher is then in error) or a full trie takes it off the
trie for good (node None: its masks are always computed). Nodes nobody stands on, with no children and no
mask, are pruned at once, so the trie holds at most the live requests' paths plus the nodes with masks.

What is stored is the grammar mask before budget steering (steering narrows the slot's copy afterwards).
A node keeps its mask only once a second request has reached it (`hits`), so unique histories (most nodes
past the forced prefix) never pay for a copy; at most `max_masks` masks are kept (LRU; a mask is
`words * 4` bytes, 16 KiB at a 128k vocabulary). Every method takes the cache's lock: the trie is moved by
the engine thread (`step`, `leave`) and read and filled by the mask worker (`lookup`, `store`).

Exactness needs every move of a cached matcher to go through `step`: the manager only ever advances one by
`accept` (the engine never rolls a matcher back; a caller that did would have to take it off the trie).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np


class HistoryNode:
    """One token history of one grammar: where its requests stand and, once shared, its mask."""

    __slots__ = ("key", "parent", "token", "children", "live", "hits", "mask", "attached")

    def __init__(self, key: str, parent: HistoryNode | None, token: int) -> None:
        self.key = key
        self.parent = parent
        self.token = token
        self.children: dict[int, HistoryNode] = {}
        self.live = 0        # requests whose history is exactly this node now
        self.hits = 0        # requests that ever reached it (>= 2: its mask is worth keeping)
        self.mask: np.ndarray | None = None
        self.attached = True  # False once pruned: a fill still in flight for it must not store


class MaskCache:
    """Per-grammar tries of token histories with the masks of shared histories (see the module docstring).

    words: int32 words per mask row. max_masks: masks kept at most (0: the cache is off, `start` returns
    None). max_nodes: trie nodes at most over all grammars (past it requests go on without a node).
    """

    def __init__(self, words: int, max_masks: int = 2048, max_nodes: int = 1 << 20) -> None:
        if max_masks < 0:
            raise ValueError(f"max_masks={max_masks}: must be >= 0 (0 turns the mask cache off)")
        if max_nodes < 1:
            raise ValueError(f"max_nodes={max_nodes}: must be >= 1")
        self.words = words
        self.max_masks = max_masks
        self.max_nodes = max_nodes
        self._lock = threading.Lock()
        self._roots: dict[str, HistoryNode] = {}
        self._lru: OrderedDict[int, HistoryNode] = OrderedDict()  # id(node) -> node holding a mask
        self.nodes = 0
        self.hits = 0      # rows filled from a stored mask
        self.shared = 0    # rows copied from another row of the same fill batch (same node, no mask yet)
        self.lookups = 0   # rows that had a node when their fill ran

    @property
    def enabled(self) -> bool:
        return self.max_masks > 0

    def start(self, key: str) -> HistoryNode | None:
        """The initial-state node of grammar `key` for a new request (None when the cache is off)."""
        if not self.enabled:
            return None
        with self._lock:
            root = self._roots.get(key)
            if root is None:
                if self.nodes >= self.max_nodes:
                    return None
                root = self._roots[key] = HistoryNode(key, None, -1)
                self.nodes += 1
            root.live += 1
            root.hits += 1
            return root

    def step(self, node: HistoryNode | None, token: int | None) -> HistoryNode | None:
        """Move a request from `node` on the accepted `token` (None: it left the trie, e.g. its matcher went
        into error); returns its new node or None."""
        if node is None:
            return None
        with self._lock:
            node.live -= 1
            child = None
            if token is not None and node.attached:
                child = node.children.get(token)
                if child is None and self.nodes < self.max_nodes:
                    child = node.children[token] = HistoryNode(node.key, node, token)
                    self.nodes += 1
                if child is not None:
                    child.live += 1
                    child.hits += 1
            self._prune(node)
            return child

    def leave(self, node: HistoryNode | None) -> None:
        """The request standing on `node` is gone (finished or aborted)."""
        self.step(node, None)

    def lookup(self, node: HistoryNode) -> np.ndarray | None:
        """The stored mask of `node` (do not modify it), or None; counts the lookup."""
        with self._lock:
            self.lookups += 1
            mask = node.mask
            if mask is not None:
                self.hits += 1
                self._lru.move_to_end(id(node))
            return mask

    def count_shared(self, rows: int) -> None:
        with self._lock:
            self.lookups += rows
            self.shared += rows

    def store(self, node: HistoryNode, row: np.ndarray, shared: bool = False) -> None:
        """Keep a copy of `row`, the freshly computed mask of `node`, if the node is shared (`shared`: other
        rows of the same fill stand on it too)."""
        with self._lock:
            if node.mask is not None or not node.attached or not (shared or node.hits >= 2):
                return
            node.mask = np.array(row, dtype=np.int32, copy=True)
            self._lru[id(node)] = node
            while len(self._lru) > self.max_masks:
                _, old = self._lru.popitem(last=False)
                old.mask = None
                self._prune(old)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"mask_cache_lookups": self.lookups, "mask_cache_hits": self.hits,
                    "mask_cache_shared": self.shared, "mask_cache_masks": len(self._lru),
                    "mask_cache_nodes": self.nodes}

    # ---- internal (lock held) ---------------------------------------------------------------------------
    def _prune(self, node: HistoryNode | None) -> None:
        while node is not None and node.attached and node.live == 0 and not node.children \
                and node.mask is None:
            node.attached = False
            self.nodes -= 1
            parent = node.parent
            if parent is None:
                del self._roots[node.key]
            else:
                del parent.children[node.token]
            node = parent
