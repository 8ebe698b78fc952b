"""Suffix decoding: drafts from suffix trees over the request's own text and over earlier outputs.

SuffixDecoding (Oliaro et al., arXiv 2411.04975; the reference implementation is Snowflake's Arctic
Inference, `arctic_inference/suffix_decoding`, in C++). Agent traffic repeats itself across requests: the
same tool-call JSON, a file re-emitted with one line changed, a plan rewritten turn after turn. Two trees
hold what may repeat:
- a per-request tree over the prompt and the output so far (what prompt lookup sees, with every match
  length up to `max_depth` instead of 1..4, and counts);
- a global tree per draft pool over recent outputs of other requests, with frequency counts, bounded in
  nodes (the oldest outputs are removed first). A pool is the API key's tenant by default (the API layer
  names it, `SpeculativeConfig.draft_pool`): one tenant's outputs never shape another's drafts, since a
  draft can leak through timing. A request without a pool drafts from its own tree only.

Per round, as in the paper: for every match length m = 1, 2, ... of the context's suffix that the tree holds,
draft a path from the matched node, always taking the most frequent child while the product of the
children's frequency ratios stays >= `min_token_prob`, for at most `factor * m + offset` tokens (a longer
match earns a longer draft); each tree's best draft by score (the sum of the path's probabilities, a longer
match winning ties) is its proposal, and the higher-scoring proposal of the two trees is the row's draft.
Arctic's defaults (vLLM's `method: suffix`) are depth 24, factor 1, offset 0, min_token_prob 0.1; ours are the
same but factor 4 (the draft policy, keyed by the match length, cuts what does not survive; replaying the
agentic bench's answers, factor 4 kept 20 % more tokens per forward than factor 1, docs/drafters.md), and an
output enters the global tree with the last 8 tokens of its prompt in front (the chat template's assistant
header), so a new answer's first tokens can match an earlier answer's.

What we do differently: Arctic compresses paths (a suffix tree proper, O(n) nodes); this is a plain trie of
every substring up to `max_depth` (O(n * depth) nodes worst case, far fewer on repetitive text) in pure
Python, kept small by the node bound. Its costs are measured in docs/drafters.md.

Pooling across replicas (`DraftPool`, implemented over Redis in `ocm_store/draft_pool.py`): a finished
output is published to the pool sink as well as folded into the local global tree, and the sink folds the
other replicas' outputs in through `SuffixDrafter.fold` from its own thread.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from service.decoding.drafters.base import Draft, DraftRow
from service.decoding.types import DecodingError

# Draft policy keys (survival is learnt per key): the match length, capped, apart for the two trees.
KEY_CAP = 15
GLOBAL_KEY_OFFSET = KEY_CAP + 1


class _Node:
    """A trie node: how many indexed suffixes pass through it, its children, and its most frequent child."""

    __slots__ = ("count", "children", "best")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] | None = None  # None for a leaf (most nodes): saves a dict each
        self.best = -1  # the token of the child with the highest count (-1: no child)


@dataclass
class SuffixMatch:
    """A tree's proposal: the draft, its score (sum of the tokens' estimated probabilities) and the length of
    the context suffix it continues."""

    tokens: list[int]
    score: float = 0.0
    match_len: int = 0


class SuffixTree:
    """Every substring of the indexed sequences up to `max_depth` tokens, with occurrence counts.

    `append` extends one growing sequence (a request's prompt and output) token by token; `add` and
    `remove` index and unindex a whole sequence (an output in the global tree). `nodes` counts the trie's
    nodes (the memory bound of the global tree)."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise DecodingError("a suffix tree needs max_depth >= 1")
        self.max_depth = max_depth
        self.root = _Node()
        self.nodes = 1
        # the nodes of the suffixes that start in the last max_depth - 1 positions of the growing sequence
        self._active: list[_Node] = []

    # ------------------------------------------------------------------ building

    def _child(self, node: _Node, token: int) -> _Node:
        """`node`'s child for `token`, created if needed, with its count raised by one."""
        children = node.children
        if children is None:
            children = node.children = {}
        child = children.get(token)
        if child is None:
            child = children[token] = _Node()
            self.nodes += 1
        child.count += 1
        best = node.best
        if best != token and (best < 0 or children[best].count < child.count):
            node.best = token
        return child

    def append(self, tokens: Sequence[int]) -> None:
        """Extend the growing sequence by `tokens`: every suffix ending at a new token is indexed."""
        depth_cap = self.max_depth
        for token in tokens:
            self.root.count += 1
            # active[i] is the node of the suffix that started len(active) - i tokens ago (depth)
            extended = [self._child(node, token) for node in self._active]
            extended.append(self._child(self.root, token))
            # a node at depth max_depth cannot grow: the oldest active suffix drops out
            self._active = extended[1:] if len(extended) >= depth_cap else extended

    def add(self, tokens: Sequence[int]) -> None:
        """Index a whole sequence (every suffix, up to max_depth tokens)."""
        for start in range(len(tokens)):
            node = self.root
            node.count += 1
            for token in tokens[start : start + self.max_depth]:
                node = self._child(node, token)

    def remove(self, tokens: Sequence[int]) -> None:
        """Unindex a sequence `add` indexed: counts fall, nodes no suffix passes through any more go."""
        for start in range(len(tokens)):
            node = self.root
            node.count -= 1
            for token in tokens[start : start + self.max_depth]:
                assert node.children is not None
                child = node.children[token]
                child.count -= 1
                if child.count == 0:
                    self.nodes -= self._size(child)
                    del node.children[token]
                if node.best == token:
                    node.best = max(node.children, key=lambda t: node.children[t].count, default=-1)
                if child.count == 0:
                    break
                node = child

    @staticmethod
    def _size(node: _Node) -> int:
        size, stack = 0, [node]
        while stack:
            n = stack.pop()
            size += 1
            if n.children:
                stack.extend(n.children.values())
        return size

    # ------------------------------------------------------------------ drafting

    def speculate(
        self, context: Sequence[int], max_tokens: int, factor: float, offset: float, min_token_prob: float
    ) -> SuffixMatch:
        """The best path draft over every match length of the context's suffix (the module docstring)."""
        best = SuffixMatch([])
        context = context[-self.max_depth :]
        length = len(context)
        for match_len in range(1, length + 1):
            node: _Node | None = self.root
            for token in context[length - match_len :]:
                children = node.children
                node = children.get(token) if children is not None else None
                if node is None:
                    break
            if node is None:  # a longer suffix contains this one, so it cannot match either
                break
            limit = min(max_tokens, int(match_len * factor + offset + 1e-6))
            tokens: list[int] = []
            prob, score = 1.0, 0.0
            while len(tokens) < limit and node.best >= 0:
                child = node.children[node.best]  # type: ignore[index]
                prob *= child.count / node.count
                if prob < min_token_prob:
                    break
                tokens.append(node.best)
                score += prob
                node = child
            if tokens and score >= best.score:
                best = SuffixMatch(tokens, score, match_len)
        return best


class DraftPool(Protocol):
    """Where finished outputs go beyond this replica (the Redis stream of ocm_store/draft_pool.py)."""

    def publish(self, pool: str, tokens: Sequence[int]) -> None:
        """Hand a finished output over; never blocks on the network, never raises."""
        ...


class GlobalSuffixTrees:
    """One global tree per draft pool, over the most recent outputs, bounded in nodes in all: past
    `max_nodes` the oldest outputs (of any pool) are removed first. Thread-safe: the engine thread drafts
    and adds, a pool's reader thread folds other replicas' outputs in."""

    def __init__(self, max_depth: int, max_nodes: int) -> None:
        self.max_depth = max_depth
        self.max_nodes = max_nodes
        self._trees: dict[str, SuffixTree] = {}
        self._order: collections.deque[tuple[str, list[int]]] = collections.deque()  # oldest first
        self._lock = threading.Lock()

    @property
    def nodes(self) -> int:
        with self._lock:
            return sum(tree.nodes for tree in self._trees.values())

    def outputs(self, pool: str) -> int:
        """How many outputs the pool's tree holds now."""
        with self._lock:
            return sum(1 for p, _ in self._order if p == pool)

    def add(self, pool: str, tokens: Sequence[int]) -> None:
        if not tokens:
            return
        tokens = list(tokens)
        with self._lock:
            tree = self._trees.get(pool)
            if tree is None:
                tree = self._trees[pool] = SuffixTree(self.max_depth)
            tree.add(tokens)
            self._order.append((pool, tokens))
            nodes = sum(t.nodes for t in self._trees.values())
            while nodes > self.max_nodes and len(self._order) > 1:
                old_pool, old = self._order.popleft()
                old_tree = self._trees[old_pool]
                before = old_tree.nodes
                old_tree.remove(old)
                nodes -= before - old_tree.nodes
                if old_tree.root.count == 0:
                    del self._trees[old_pool]

    def speculate(
        self,
        pool: str,
        context: Sequence[int],
        max_tokens: int,
        factor: float,
        offset: float,
        min_token_prob: float,
    ) -> SuffixMatch:
        with self._lock:
            tree = self._trees.get(pool)
            if tree is None:
                return SuffixMatch([])
            return tree.speculate(context, max_tokens, factor, offset, min_token_prob)


class SuffixDrafter:
    """Shared by every request of an engine: holds the global trees; `rows()` holds the per-request trees."""

    name = "suffix"
    identity = "suffix"

    def __init__(
        self,
        max_depth: int = 24,
        max_spec_factor: float = 4.0,
        max_spec_offset: float = 0.0,
        min_token_prob: float = 0.1,
        max_global_nodes: int = 1_000_000,
        prompt_tail: int = 8,
    ) -> None:
        if not 0 < min_token_prob <= 1:
            raise DecodingError(f"min_token_prob must be in (0, 1], got {min_token_prob}")
        self.max_depth = max_depth
        self.factor = max_spec_factor
        self.offset = max_spec_offset
        self.min_token_prob = min_token_prob
        # prompt tokens indexed in front of an output in the global tree (the chat template's assistant header,
        # the end of the user's turn), so an answer's first tokens can match before it has written any
        self.prompt_tail = prompt_tail
        self.global_trees = GlobalSuffixTrees(max_depth, max_global_nodes)
        self.pool_sink: DraftPool | None = None  # set by the runtime when replicas pool (Redis)

    def rows(self) -> SuffixRows:
        return SuffixRows(self)

    @staticmethod
    def match_length(draft: Draft) -> int:
        """How many tokens of the sequence's suffix matched behind `draft` (read off its key, either trie)."""
        return draft.key % GLOBAL_KEY_OFFSET

    def finished(self, pool: str, output: Sequence[int]) -> None:
        """A request's output: into this replica's tree of its pool, and to the other replicas."""
        if not output:
            return
        self.global_trees.add(pool, output)
        if self.pool_sink is not None:
            self.pool_sink.publish(pool, output)

    def fold(self, pool: str, output: Sequence[int]) -> None:
        """Another replica's output (from the pool sink's reader), into this replica's tree of its pool."""
        self.global_trees.add(pool, output)

    def propose_one(self, local: SuffixTree, pool: str | None, context: Sequence[int], k: int) -> Draft:
        args = (k, self.factor, self.offset, self.min_token_prob)
        own = local.speculate(context, *args)
        key = min(own.match_len, KEY_CAP)
        if pool is not None:
            shared = self.global_trees.speculate(pool, context, *args)
            if shared.score > own.score:
                own, key = shared, GLOBAL_KEY_OFFSET + min(shared.match_len, KEY_CAP)
        return Draft(own.tokens, key=key) if own.tokens else Draft([])


@dataclass
class _Sequence:
    tree: SuffixTree
    committed: Sequence[int]  # the row's own list: it grows as the target keeps tokens
    indexed: int  # tokens of `committed` in the tree
    prompt_len: int
    pool: str | None


class SuffixRows:
    """The per-request trees of a batch's sequences. A sequence's tree is built at its first proposal (its
    prompt) and extended by what the target kept since; when it leaves, its output joins the global tree."""

    def __init__(self, drafter: SuffixDrafter) -> None:
        self.drafter = drafter
        self.sequences: dict[object, _Sequence] = {}

    def prefill(self, sequence: object, tokens: Sequence[int]) -> None:
        return None  # the tree is built from `committed` at the first proposal

    def propose(self, rows: Sequence[DraftRow]) -> list[Draft]:
        drafts = []
        for row in rows:
            state = self.sequences.get(row.sequence)
            if state is None:
                tree = SuffixTree(self.drafter.max_depth)
                state = _Sequence(tree, row.committed, 0, len(row.committed), row.pool)
                self.sequences[row.sequence] = state
            state.committed = row.committed
            committed = row.committed
            if len(committed) > state.indexed:
                state.tree.append(committed[state.indexed :])
                state.indexed = len(committed)
            drafts.append(self.drafter.propose_one(state.tree, state.pool, committed, row.max_tokens))
        return drafts

    def leave(self, sequence: object) -> None:
        state = self.sequences.pop(sequence, None)
        if state is not None and state.pool is not None:
            start = max(0, state.prompt_len - self.drafter.prompt_tail)
            self.drafter.finished(state.pool, list(state.committed[start:]))
