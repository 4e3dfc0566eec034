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

Grammars with a state key (state_key.py: JSON Schemas with free strings or number classes) are keyed by
grammar state instead of token history: the key is a hashable value, not a trie node, and its masks live in
the same LRU. A state whose key abstracts it (a settled position, a free string's count, a number class)
recurs by construction, so its mask is kept from its first computation; a key that ends in VERBATIM_MARK
(the tracker is inside a value it keeps verbatim: an enum, a key, free text after an escape) is kept only
once it has been computed before (the bounded `_seen` set) or shared within a fill batch, so unique states
do not push out the recurring ones. (Measured, fillprobe.py steps --cold-cache: with every state key
gated, a cold cache computed each count of a free string twice; ~half the rows computed then.)

Masks are rows of one preallocated table (`table`, [max_masks, words], made on the first store): the mask
worker copies a batch's hits into their slots from it (`lookup_rows`), the engine thread a hit at submit
(`copy_stored`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np


class HistoryNode:
    """One token history of one grammar: where its requests stand and, once shared, its mask."""

    __slots__ = ("key", "parent", "token", "children", "live", "hits", "row", "attached")

    def __init__(self, key: str, parent: HistoryNode | None, token: int) -> None:
        self.key = key
        self.parent = parent
        self.token = token
        self.children: dict[int, HistoryNode] = {}
        self.live = 0        # requests whose history is exactly this node now
        self.hits = 0        # requests that ever reached it (>= 2: its mask is worth keeping)
        self.row = -1        # its mask's row in MaskCache.table (-1: none)
        self.attached = True  # False once pruned: a fill still in flight for it must not store


CacheKey = HistoryNode | tuple  # a trie node, or a state key (state_key.py)
VERBATIM_MARK = "v"  # the last element of a state key whose state may never recur (see the docstring)


class MaskCache:
    """Per-grammar tries of token histories and state keys, with the masks of shared ones (see the module
    docstring).

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
        self.table: np.ndarray | None = None          # [max_masks, words] once a mask is stored
        self._free_rows: list[int] = []
        # id(node) -> node holding a mask, or state key -> itself; least recently used first
        self._lru: OrderedDict[int | tuple, HistoryNode | tuple] = OrderedDict()
        self._states: dict[tuple, int] = {}            # state key -> its mask's table row
        self._seen: OrderedDict[tuple, None] = OrderedDict()  # state keys computed once (bounded)
        self.nodes = 0
        self.hits = 0      # rows filled from a stored mask
        self.shared = 0    # rows copied from another row of the same fill batch (same key, no mask yet)
        self.lookups = 0   # rows that had a key when their fill ran

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

    def lookup(self, node: CacheKey) -> np.ndarray | None:
        """The stored mask of `node` (a view: do not modify it), or None; counts one row's lookup."""
        row = self.lookup_rows([node], [1])[0]
        return None if row < 0 else self.table[row]

    def lookup_rows(self, keys: Sequence[CacheKey], rows: Sequence[int]) -> list[int]:
        """The table row of each key's stored mask, or -1. `rows[i]`: the rows of the batch on keys[i]; a
        found key counts them all as hits, a missing one counts one lookup (its copies: `count_shared`).
        Rows stay valid until the next `store` or `clear` (the mask worker is the only one storing)."""
        out = []
        with self._lock:
            for key, n in zip(keys, rows):
                row, lru = self._row_of(key)
                if row >= 0:
                    self.lookups += n
                    self.hits += n
                    self._lru.move_to_end(lru)
                else:
                    self.lookups += 1
                out.append(row)
        return out

    def copy_stored(self, key: CacheKey, dst: np.ndarray) -> bool:
        """Copy the stored mask of `key` into `dst` and count one row's hit; False (nothing counted)
        when none is stored. Under the lock: the mask worker may evict the row meanwhile."""
        with self._lock:
            row, lru = self._row_of(key)
            if row < 0:
                return False
            np.copyto(dst, self.table[row])
            self.lookups += 1
            self.hits += 1
            self._lru.move_to_end(lru)
            return True

    def count_shared(self, rows: int) -> None:
        with self._lock:
            self.lookups += rows
            self.shared += rows

    def store(self, node: CacheKey, row: np.ndarray, shared: bool = False) -> None:
        """Keep a copy of `row`, the freshly computed mask of `node`, if the node is shared (`shared`: other
        rows of the same fill stand on it too; a state key: also when it was computed before)."""
        with self._lock:
            if not isinstance(node, HistoryNode):
                self._store_state(node, row, shared)
                return
            if node.row >= 0 or not node.attached or not (shared or node.hits >= 2):
                return
            node.row = self._put(row)
            self._lru[id(node)] = node

    def clear(self) -> None:
        """Drop every stored mask and the record of computed state keys (the trie keeps its live paths):
        for measuring a cold cache; masks are the same either way."""
        with self._lock:
            for old in list(self._lru.values()):
                if isinstance(old, HistoryNode):
                    old.row = -1
                    self._prune(old)
            self._lru.clear()
            self._states.clear()
            self._seen.clear()
            self._free_rows = list(range(self.max_masks - 1, -1, -1)) if self.table is not None else []

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"mask_cache_lookups": self.lookups, "mask_cache_hits": self.hits,
                    "mask_cache_shared": self.shared, "mask_cache_masks": len(self._lru),
                    "mask_cache_state_masks": len(self._states), "mask_cache_nodes": self.nodes}

    # ---- internal (lock held) ---------------------------------------------------------------------------
    def _row_of(self, key: CacheKey) -> tuple[int, int | tuple]:
        """(the table row of key's stored mask or -1, key's entry in the LRU)."""
        if isinstance(key, HistoryNode):
            return key.row, id(key)
        return self._states.get(key, -1), key

    def _put(self, mask: np.ndarray) -> int:
        """A table row holding a copy of `mask` (the least recently used mask gives its row when full)."""
        if self.table is None:
            self.table = np.empty((self.max_masks, self.words), dtype=np.int32)
            self._free_rows = list(range(self.max_masks - 1, -1, -1))
        if not self._free_rows:
            _, old = self._lru.popitem(last=False)
            if isinstance(old, HistoryNode):
                self._free_rows.append(old.row)
                old.row = -1
                self._prune(old)
            else:
                self._free_rows.append(self._states.pop(old))
        row = self._free_rows.pop()
        self.table[row] = mask
        return row

    def _store_state(self, key: tuple, row: np.ndarray, shared: bool) -> None:
        if key in self._states:
            return
        if not shared and key[-1] == VERBATIM_MARK and key not in self._seen:
            self._seen[key] = None
            if len(self._seen) > 4 * self.max_masks:
                self._seen.popitem(last=False)
            return
        self._seen.pop(key, None)
        self._states[key] = self._put(row)
        self._lru[key] = key

    def _prune(self, node: HistoryNode | None) -> None:
        while node is not None and node.attached and node.live == 0 and not node.children \
                and node.row < 0:
            node.attached = False
            self.nodes -= 1
            parent = node.parent
            if parent is None:
                del self._roots[node.key]
            else:
                del parent.children[node.token]
            node = parent
