"""Suffix decoding: drafts from the request's own text and from suffix trees over earlier outputs.

SuffixDecoding (Oliaro et al., arXiv 2411.04975; the reference implementation is Snowflake's Arctic
Inference, `arctic_inference/suffix_decoding`, in C++). Agent traffic repeats itself across requests: the
same tool-call JSON, a file re-emitted with one line changed, a plan rewritten turn after turn. Two sources
hold what may repeat:
- the request's prompt and output so far (`SequenceIndex`: what prompt lookup sees, with every match length
  up to `max_depth` instead of 1..4, and counts);
- a global tree per draft pool over recent outputs of other requests (`SuffixTree`), with frequency counts,
  bounded in nodes (the oldest outputs are removed first). A pool is the API key's tenant by default (the API
  layer names it, `SpeculativeConfig.draft_pool`): one tenant's outputs never shape another's drafts, since a
  draft can leak through timing. A request without a pool drafts from its own text only.

Per round, as in the paper: for every match length m = 1, 2, ... of the context's suffix that a source holds,
draft a path from the matched occurrences, always taking the most frequent next token (the most recent one
among equally frequent: what the text just wrote is the likeliest to recur, prompt lookup's finding too) while
the product of the steps' frequency ratios stays >= `min_token_prob`, for at most `factor * m + offset`
tokens (a longer match earns a longer draft); each source's best draft by score (the sum of the path's
probabilities, a longer match winning ties) is its proposal, and the higher-scoring proposal of the two is the
row's draft. Arctic's defaults (vLLM's `method: suffix`) are depth 24, factor 1, offset 0, min_token_prob
0.1; ours are the same but factor 4 (the draft policy, keyed by the match length, cuts what does not
survive; replaying the agentic bench's answers, factor 4 kept 20 % more tokens per forward than factor 1),
and an output enters the global tree with the last 8 tokens of its prompt in front (the chat template's
assistant header), so a new answer's first tokens can match an earlier answer's.

What we do differently, and why (measured on the agentic bench, docs/benchmarks.md, "Suffix decoding,
second pass"):
- The request's own text is not a trie but a position index (`SequenceIndex`: token -> where it occurs),
  whose occurrences are narrowed to the matched suffix at proposal time. A pure-Python trie of every substring
  up to depth 24 cost ~60 us a prompt token (60 ms for a 1,000-token agent prompt, a fifth of its prefill on
  a Zen 4 core), and, built at the first proposal, it counted as drafting time: the draft policy, which
  weighs a drafter's seconds per drafted position, then drafted little for the rest of the request. The index
  costs ~0.1 us a token, filled from the prefill chunks, and ~60 us a proposal. Its drafts also run past the
  trie's depth (a re-emitted file is copied 16 tokens at a time whatever the match length), and its counts
  leave out the context's own final occurrence, which has no continuation (in a trie over the context it made
  a match seen once before look 1/2 likely, so a pooled answer won where the request's own text was right).
- The global tree is a plain trie of every substring up to `max_depth` (Arctic compresses paths: a suffix
  tree proper, O(n) nodes), in pure Python, kept small by the node bound: an output is added once, when its
  request leaves.

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
        self.best = -1  # the child with the highest count, the latest to reach it among equals (-1: none)


@dataclass
class SuffixMatch:
    """A tree's proposal: the draft, its score (sum of the tokens' estimated probabilities) and the length of
    the context suffix it continues."""

    tokens: list[int]
    score: float = 0.0
    match_len: int = 0


class SuffixTree:
    """Every substring of the indexed sequences up to `max_depth` tokens, with occurrence counts: a pool's
    global tree. `add` and `remove` index and unindex a whole sequence (an output); `nodes` counts the trie's
    nodes (the memory bound of the global trees)."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise DecodingError("a suffix tree needs max_depth >= 1")
        self.max_depth = max_depth
        self.root = _Node()
        self.nodes = 1

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
        if best != token and (best < 0 or children[best].count <= child.count):
            node.best = token
        return child

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


class SequenceIndex:
    """One request's prompt and output so far, and where each token occurs in it: what the request's own drafts
    come from. `append` costs a list append a token; a proposal narrows the occurrences of the last token to
    those that match the context's suffix one more token at a time (up to `max_depth`), and drafts by reading
    the text after them, so a draft is not bounded by a tree's depth.

    Only the last token's `max_occurrences` most recent occurrences are narrowed: on degenerate text (one
    token 4,000 times) every occurrence took ~200 ms a proposal, 64 take 0.2 ms, and replaying the agentic
    bench's three recorded runs kept the same tokens a forward with 32 to 100,000 (16 lost 0.01)."""

    def __init__(self, max_depth: int, max_occurrences: int = 64) -> None:
        if max_depth < 1 or max_occurrences < 1:
            raise DecodingError("a suffix index needs max_depth >= 1 and max_occurrences >= 1")
        self.max_depth = max_depth
        self.max_occurrences = max_occurrences
        self.tokens: list[int] = []
        self._at: dict[int, list[int]] = {}  # token -> its positions in `tokens`, ascending

    def append(self, tokens: Sequence[int]) -> None:
        at, text = self._at, self.tokens
        for token in tokens:
            positions = at.get(token)
            if positions is None:
                at[token] = [len(text)]
            else:
                positions.append(len(text))
            text.append(token)

    def speculate(self, max_tokens: int, factor: float, offset: float, min_token_prob: float) -> SuffixMatch:
        """The best path draft continuing the text, over every match length of its suffix (the module
        docstring): what `SuffixTree.speculate` drafts from a trie over this text, without the trie's depth
        bound on the draft and counting only occurrences that have a continuation."""
        text = self.tokens
        n = len(text)
        best = SuffixMatch([])
        if n < 2:
            return best
        # end positions of the earlier occurrences of the suffix matched so far (the last one is the suffix)
        ends = self._at[text[-1]][-1 - self.max_occurrences : -1]
        match_len = 1
        while ends:
            longer: list[int] = []
            if match_len < min(self.max_depth, n - 1):
                before = text[n - 1 - match_len]
                longer = [e for e in ends if e >= match_len and text[e - match_len] == before]
            if len(longer) < len(ends):  # the matched occurrences change past here: draft from this length
                limit = min(max_tokens, int(match_len * factor + offset + 1e-6))
                draft = self._path(ends, limit, min_token_prob)
                if draft.tokens and draft.score >= best.score:
                    draft.match_len = match_len
                    best = draft
            ends = longer
            match_len += 1
        return best

    def _path(self, ends: list[int], limit: int, min_token_prob: float) -> SuffixMatch:
        """From occurrences ending at `ends`: the most frequent next token (the latest among equals) while the
        path's probability stays >= min_token_prob, at most `limit` tokens."""
        text, last = self.tokens, len(self.tokens) - 1
        tokens: list[int] = []
        prob, score = 1.0, 0.0
        while len(tokens) < limit:
            counts: dict[int, int] = {}
            for e in ends:  # ascending: a later occurrence reaches an equal count later
                if e < last:
                    token = text[e + 1]
                    counts[token] = counts.get(token, 0) + 1
            if not counts:
                break
            top = max(counts.values())
            pick = next(text[e + 1] for e in reversed(ends) if e < last and counts[text[e + 1]] == top)
            prob *= top / sum(counts.values())
            if prob < min_token_prob:
                break
            tokens.append(pick)
            score += prob
            ends = [e + 1 for e in ends if e < last and text[e + 1] == pick]
        return SuffixMatch(tokens, score)


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

    def propose_one(self, local: SequenceIndex, pool: str | None, k: int) -> Draft:
        """A row's draft: the better-scored of its own text's and its pool's proposals."""
        args = (k, self.factor, self.offset, self.min_token_prob)
        own = local.speculate(*args)
        key = min(own.match_len, KEY_CAP)
        if pool is not None:
            shared = self.global_trees.speculate(pool, local.tokens, *args)
            if shared.score > own.score:
                own, key = shared, GLOBAL_KEY_OFFSET + min(shared.match_len, KEY_CAP)
        return Draft(own.tokens, key=key) if own.tokens else Draft([])


@dataclass
class _Sequence:
    index: SequenceIndex  # its tokens are the row's committed tokens (once a proposal has caught up)
    prompt_len: int  # 0 until the first proposal
    pool: str | None
    committed: Sequence[int] = ()  # the row's own list: it grows as the target keeps tokens


class SuffixRows:
    """The indexes of a batch's sequences. A sequence's index is filled from its prefill chunks (as the target
    sees them: the cost stays out of the drafting time the draft policy weighs) and extended by what the
    target kept since; when it leaves, its output joins its pool's global tree."""

    def __init__(self, drafter: SuffixDrafter) -> None:
        self.drafter = drafter
        self.sequences: dict[object, _Sequence] = {}

    def _state(self, sequence: object) -> _Sequence:
        state = self.sequences.get(sequence)
        if state is None:
            state = self.sequences[sequence] = _Sequence(SequenceIndex(self.drafter.max_depth), 0, None)
        return state

    def prefill(self, sequence: object, tokens: Sequence[int]) -> None:
        self._state(sequence).index.append(tokens)

    def propose(self, rows: Sequence[DraftRow]) -> list[Draft]:
        drafts = []
        for row in rows:
            state = self._state(row.sequence)
            index, committed = state.index, row.committed
            if state.prompt_len == 0:
                state.prompt_len, state.pool = len(committed), row.pool
            state.committed = committed
            indexed = len(index.tokens)
            # `committed` only grows by kept tokens (drafters/base.py); anything else starts the index afresh
            if indexed > len(committed) or (indexed and index.tokens[-1] != committed[indexed - 1]):
                index = state.index = SequenceIndex(self.drafter.max_depth)
                indexed = 0
            if len(committed) > indexed:
                index.append(committed[indexed:])
            drafts.append(self.drafter.propose_one(index, state.pool, row.max_tokens))
        return drafts

    def leave(self, sequence: object) -> None:
        state = self.sequences.pop(sequence, None)
        if state is not None and state.pool is not None:
            start = max(0, state.prompt_len - self.drafter.prompt_tail)
            # the row's list, not the index: the last round's kept tokens were never proposed on
            self.drafter.finished(state.pool, list(state.committed[start:]))
