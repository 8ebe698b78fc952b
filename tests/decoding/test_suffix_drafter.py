"""The suffix drafter (SuffixDecoding, arXiv 2411.04975): its global trees against brute-force counts, the
request's own index against a brute-force draft rule (most frequent path, the latest among equals, match-length-
adaptive length, probability floor, only occurrences with a continuation counted), the bounded global tree,
pools kept apart, and strict SD with it identical to vanilla through the real engine on the embedded model."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from service.decoding import CombinedDrafter, Engine, HeadDrafter, Method, SamplingParams, SpeculativeConfig
from service.decoding.draft_head import EMBEDDED_HEAD_DIR
from service.decoding.drafters import DraftRow
from service.decoding.drafters.suffix import (
    GLOBAL_KEY_OFFSET,
    GlobalSuffixTrees,
    SequenceIndex,
    SuffixDrafter,
    SuffixTree,
    _Node,
)
from service.decoding.engine import run_to_end
from service.decoding.text import encode_chat


def substring_counts(sequences: list[list[int]], depth: int) -> Counter:
    """Every substring of up to `depth` tokens of every sequence, counted (what the trie must hold)."""
    counts: Counter = Counter()
    for seq in sequences:
        for start in range(len(seq)):
            for end in range(start + 1, min(start + depth, len(seq)) + 1):
                counts[tuple(seq[start:end])] += 1
    return counts


def trie_counts(tree: SuffixTree) -> Counter:
    counts: Counter = Counter()
    stack: list[tuple[tuple[int, ...], _Node]] = [((), tree.root)]
    nodes = 0
    while stack:
        path, node = stack.pop()
        nodes += 1
        if path:
            counts[path] = node.count
        for token, child in (node.children or {}).items():
            stack.append((path + (token,), child))
    assert nodes == tree.nodes, "the node count drifted from the trie"
    return counts


def check_best(tree: SuffixTree) -> None:
    stack = [tree.root]
    while stack:
        node = stack.pop()
        children = node.children or {}
        if not children:
            assert node.best == -1
            continue
        assert children[node.best].count == max(c.count for c in children.values())
        stack.extend(children.values())


@pytest.mark.parametrize("depth", [1, 3, 8])
def test_add_indexes_every_substring_with_its_count(depth):
    rng = random.Random(depth)
    seqs = [[rng.randrange(5) for _ in range(rng.randrange(1, 40))] for _ in range(6)]
    whole = SuffixTree(depth)
    for seq in seqs:
        whole.add(seq)
    assert trie_counts(whole) == substring_counts(seqs, depth)
    check_best(whole)


def brute_force_draft(
    text: list[int], k: int, factor: float, depth: int, floor: float
) -> tuple[list[int], int]:
    """The request's own draft by the rule, slowly: for every match length m, the earlier occurrences of the
    text's last m tokens; from them, the most frequent next token (the latest among equals) over the
    occurrences that have one, while the path's probability stays >= floor, at most factor * m tokens; the
    best sum of probabilities wins, a longer match winning ties. (tokens, match length)"""
    n = len(text)
    best: tuple[float, list[int], int] = (0.0, [], 0)
    for m in range(1, min(depth, n - 1) + 1):
        ends = [e for e in range(m - 1, n - 1) if text[e - m + 1 : e + 1] == text[n - m :]]
        if not ends:
            break
        tokens: list[int] = []
        prob = score = 0.0
        prob = 1.0
        while len(tokens) < min(k, int(m * factor + 1e-6)):
            nexts = [(text[e + 1], e) for e in ends if e + 1 < n]
            if not nexts:
                break
            counts = Counter(t for t, _ in nexts)
            top = max(counts.values())
            pick = max((e, t) for t, e in nexts if counts[t] == top)[1]
            prob *= top / len(nexts)
            if prob < floor:
                break
            tokens.append(pick)
            score += prob
            ends = [e + 1 for t, e in nexts if t == pick]
        if tokens and score >= best[0]:
            best = (score, tokens, m)
    return best[1], best[2]


@pytest.mark.parametrize("seed", range(12))
def test_the_request_index_drafts_what_the_rule_says(seed):
    """Random texts over small alphabets (many repeats, many ties), grown in uneven pieces as rounds keep
    tokens, against the brute-force rule after every piece."""
    rng = random.Random(seed)
    alphabet = rng.choice([2, 3, 6])
    depth = rng.choice([3, 6, 24])
    factor = rng.choice([1.0, 4.0])
    floor = rng.choice([0.1, 0.3])
    text = [rng.randrange(alphabet) for _ in range(rng.randrange(5, 120))]
    index = SequenceIndex(depth, max_occurrences=1000)  # every occurrence: the rule as stated
    done = 0
    while done < len(text):
        step = rng.randrange(1, 9)
        index.append(text[done : done + step])
        done = min(len(text), done + step)
        got = index.speculate(8, factor, 0.0, floor)
        want = brute_force_draft(text[:done], 8, factor, depth, floor)
        assert (got.tokens, got.match_len if got.tokens else 0) == want, text[:done]


def test_the_request_index_counts_only_occurrences_that_continue_and_prefers_the_latest():
    index = SequenceIndex(24)
    index.append([1, 2, 3, 4, 5, 1, 2, 3])
    draft = index.speculate(8, 4.0, 0.0, 0.1)
    # seen once before: probability 1, not 1/2 (the text's own final [1, 2, 3] has nothing after it)
    assert draft.tokens == [4, 5, 1, 2, 3] and draft.score == 5.0 and draft.match_len == 3
    ties = SequenceIndex(24)
    ties.append([7, 5, 0, 7, 6, 0, 7])  # after 7: 5 once, then 6 once: the latest wins the tie
    assert ties.speculate(1, 4.0, 0.0, 0.1).tokens == [6]


def test_the_request_index_narrows_only_the_most_recent_occurrences():
    """A bound on the work of a proposal on degenerate text: only the last token's `max_occurrences` latest
    occurrences are narrowed, so an older, longer match is not seen."""
    old_match, recent = [1, 2, 3, 9, 9], [[7, 3, 4] for _ in range(3)]
    text = [*old_match, *sum(recent, []), 1, 2, 3]
    for cap, draft in ((100, [9, 9, 7]), (3, [4, 7, 3])):
        index = SequenceIndex(24, max_occurrences=cap)
        index.append(text)
        assert index.speculate(3, 4.0, 0.0, 0.1).tokens == draft
    degenerate = SequenceIndex(24)
    degenerate.append([5] * 4000)
    assert degenerate.speculate(16, 4.0, 0.0, 0.1).tokens == [5] * 16


def test_the_request_index_drafts_past_its_match_depth():
    """A trie of depth 4 could draft at most 4 - m tokens after an m-token match; the index reads the text."""
    run = list(range(100, 140))
    index = SequenceIndex(4)
    index.append([*run, 7, *run[:5]])
    assert index.speculate(16, 4.0, 0.0, 0.1).tokens == run[5:21]


def test_remove_undoes_add_and_frees_the_nodes():
    rng = random.Random(7)
    seqs = [[rng.randrange(4) for _ in range(30)] for _ in range(5)]
    tree = SuffixTree(6)
    for seq in seqs:
        tree.add(seq)
    for gone in range(3):
        tree.remove(seqs[gone])
        assert trie_counts(tree) == substring_counts(seqs[gone + 1 :], 6)
        check_best(tree)
    for seq in seqs[3:]:
        tree.remove(seq)
    assert tree.nodes == 1 and tree.root.count == 0 and not tree.root.children


def test_the_draft_follows_the_most_frequent_continuation_of_the_longest_match():
    tree = SuffixTree(16)
    # after [1, 2]: 3 then 4 twice, 5 once; after [9, 1, 2] only 5, 6, 7, 8 (a longer, unique match)
    for seq in ([1, 2, 3, 4], [1, 2, 3, 4], [9, 1, 2, 5, 6, 7, 8]):
        tree.add(seq)
    draft = tree.speculate([0, 1, 2], max_tokens=8, factor=4, offset=0, min_token_prob=0.1)
    assert draft.tokens == [3, 4] and draft.match_len == 2
    assert draft.score == pytest.approx(2 / 3 + 2 / 3)
    draft = tree.speculate([9, 1, 2], max_tokens=8, factor=4, offset=0, min_token_prob=0.1)
    assert draft.tokens == [5, 6, 7, 8] and draft.match_len == 3


def test_draft_length_grows_with_the_match_and_stops_below_the_probability_floor():
    tree = SuffixTree(24)
    tree.add(list(range(100, 130)))
    context = [100, 101, 102]  # a 3-token match: factor 1 allows 3 tokens, factor 2 six
    assert tree.speculate(context, 20, 1.0, 0.0, 0.1).tokens == [103, 104, 105]
    assert tree.speculate(context, 20, 2.0, 0.0, 0.1).tokens == list(range(103, 109))
    assert tree.speculate(context, 4, 2.0, 0.0, 0.1).tokens == list(range(103, 107))  # the row's budget
    assert tree.speculate([7, 8], 20, 1.0, 0.0, 0.1).tokens == []  # no match
    # a branch where the likeliest continuation has 1/4 of the mass: under a floor of 0.3 nothing is drafted
    branchy = SuffixTree(8)
    for tail in (1, 2, 3, 4):
        branchy.add([50, tail])
    assert branchy.speculate([50], 4, 4.0, 0.0, 0.3).tokens == []
    assert branchy.speculate([50], 4, 4.0, 0.0, 0.2).tokens == [4]  # four equals: the latest added


def test_the_global_trees_are_bounded_and_evict_the_oldest_outputs():
    trees = GlobalSuffixTrees(max_depth=8, max_nodes=400)
    rng = random.Random(3)
    outputs = [[rng.randrange(1000) for _ in range(20)] for _ in range(30)]
    for output in outputs:
        trees.add("t", output)
        assert trees.nodes <= 400
    kept = trees.outputs("t")
    assert 1 <= kept < len(outputs)
    # the newest outputs are still drafted from, the oldest not
    newest, oldest = outputs[-1], outputs[0]
    # (a depth-8 trie drafts at most 8 - m tokens after an m-token match)
    drafted = trees.speculate("t", newest[:4], 8, 2.0, 0, 0.1).tokens
    assert len(drafted) >= 4 and drafted == newest[4 : 4 + len(drafted)]
    gone = trees.speculate("t", oldest[:4], 8, 2.0, 0, 0.1)  # at most a chance 1-token match elsewhere
    assert gone.match_len <= 1 and gone.tokens[:2] != oldest[4:6]


def row(sequence: object, committed: list[int], k: int, pool: str | None) -> DraftRow:
    return DraftRow(sequence, committed, k, SamplingParams(), None, None, pool)


def test_outputs_shape_drafts_of_their_own_pool_only():
    drafter = SuffixDrafter(max_spec_factor=1.0)
    prompt, output = [5, 6, 7], list(range(200, 240))
    rows = drafter.rows()
    seq = object()
    rows.propose([row(seq, prompt, 8, "tenant-a")])
    committed = prompt + output  # what the target kept by the time the sequence leaves
    rows.propose([row(seq, committed, 8, "tenant-a")])
    rows.leave(seq)
    assert drafter.global_trees.outputs("tenant-a") == 1
    again = [1, 2, 200, 201, 202, 203]
    same = rows.propose([row(object(), again, 8, "tenant-a")])[0]
    assert same.tokens == list(range(204, 208)) and same.key > GLOBAL_KEY_OFFSET  # a 4-token match: 4
    assert rows.propose([row(object(), again, 8, "tenant-b")])[0].tokens == []
    assert rows.propose([row(object(), again, 8, None)])[0].tokens == []
    assert drafter.global_trees.outputs("tenant-b") == 0


def test_the_request_index_drafts_from_the_prompt_and_the_output_so_far():
    rows = SuffixDrafter(max_spec_factor=1.0).rows()
    seq = object()
    text = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]
    draft = rows.propose([row(seq, text, 6, None)])[0]
    assert draft.tokens == [4, 5, 6] and draft.key == 3  # a 3-token match drafts 3 at factor 1
    text += [4, 5, 6, 7]
    assert rows.propose([row(seq, text, 6, None)])[0].tokens == [8, 9, 1, 2, 3, 4]


def test_the_index_fills_from_prefill_chunks_and_restarts_on_text_it_did_not_see():
    """Prefill chunks fill the index (so a first proposal indexes one token, not the prompt); a committed text
    that does not continue what was indexed (a drafter's state rebuilt, a bug) starts the index afresh."""
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]
    rows, seq = SuffixDrafter(max_spec_factor=1.0).rows(), object()
    rows.prefill(seq, prompt[:5])
    rows.prefill(seq, prompt[5:-1])
    assert rows.sequences[seq].index.tokens == prompt[:-1]
    assert rows.propose([row(seq, prompt, 6, None)])[0].tokens == [4, 5, 6]
    other = [9, 8, 7, 9, 8]
    assert rows.propose([row(seq, other, 6, None)])[0].tokens == [7, 9]
    assert rows.sequences[seq].index.tokens == other


# ---------------------------------------------------------------- through the real engine


PROMPTS = [
    'Call the tool: {"name": "read_file", "arguments": {"path": "src/app.py"}}. Repeat the call exactly.',
    "Rewrite this function with a docstring:\ndef add(a, b):\n    return a + b\n",
    "List the planets of the solar system, one per line.",
]


@pytest.mark.parametrize("name", ["suffix", "combined-suffix"])
def test_strict_sd_with_the_suffix_drafter_is_vanilla_token_for_token(embedded, single_thread, name):
    """Twice over each prompt in one pool, so the second pass drafts from the first pass's outputs (the
    global tree) as well as its own text: output identical to vanilla, and the pool made drafts longer. Also
    inside `combined-suffix` (the head where the suffix drafter matches fewer than 3 tokens)."""
    drafter = SuffixDrafter()
    if name == "suffix":
        engine = Engine(embedded, {"suffix": drafter})
    else:
        head = HeadDrafter(embedded, EMBEDDED_HEAD_DIR)
        engine = Engine(embedded, {name: CombinedDrafter(drafter, head, name=name)})
    tok = embedded.tokenizer
    sampling = SamplingParams(temperature=0.0, max_tokens=48)
    vanilla = SpeculativeConfig(method=Method.VANILLA)
    sd = SpeculativeConfig(method=Method.SD, num_speculative_tokens=16, draft_pool="p")
    kept = {0: 0, 1: 0}
    forwards = {0: 0, 1: 0}
    for pass_ in (0, 1):
        for prompt in PROMPTS:
            ids = encode_chat(tok, [{"role": "user", "content": prompt}])
            plain = run_to_end(engine.generate(ids, sampling, vanilla))
            spec = run_to_end(engine.generate(ids, sampling, sd, drafter=name))
            assert [t.token_id for t in spec.tokens] == [t.token_id for t in plain.tokens], prompt
            kept[pass_] += spec.stats.num_accepted
            forwards[pass_] += spec.stats.target_forwards
    assert drafter.global_trees.outputs("p") == 2 * len(PROMPTS)
    # the second pass repeats outputs the pool holds: strictly more accepted tokens in fewer forwards
    assert kept[1] > kept[0] and forwards[1] < forwards[0]


def test_an_answer_enters_the_pool_behind_its_prompts_last_tokens():
    """`prompt_tail`: an answer's first tokens match an earlier answer's after the same prompt ending (the chat
    template's assistant header), before the new answer has written anything."""
    header = [90, 91, 92]
    for tail, expected in ((0, []), (3, [300, 301, 302])):
        drafter = SuffixDrafter(max_spec_factor=1.0, prompt_tail=tail)
        rows, seq = drafter.rows(), object()
        rows.propose([row(seq, [7, 8, *header], 8, "p")])
        rows.propose([row(seq, [7, 8, *header, 300, 301, 302, 303], 8, "p")])
        rows.leave(seq)
        assert rows.propose([row(object(), [5, *header], 8, "p")])[0].tokens == expected


def test_suffix_rows_batch_together_stay_lossless_and_pool_what_they_finish(embedded, single_thread):
    """Three rows of one pool in one batch, joining at different steps (suffix, combined-suffix): strict SD
    equals each prompt's vanilla output; every finished row's answer is in the pool afterwards, and csd with
    the suffix drafter runs on the same engine (its OCM namespace is the drafter's)."""
    from ocm_store import InMemoryStore, Namespace
    from service.decoding.batch import Batch
    from tests.decoding.test_batch import run_batch
    from tests.decoding.test_lossless import assert_same_tokens

    suffix = SuffixDrafter()
    head = HeadDrafter(embedded, EMBEDDED_HEAD_DIR)
    drafters = {"suffix": suffix, "combined-suffix": CombinedDrafter(suffix, head, name="combined-suffix")}
    store = InMemoryStore()
    memories = {n: store.memory(Namespace("t", n, "v")) for n in drafters}
    engine = Engine(embedded, drafters, memories)
    tok, sampling = embedded.tokenizer, SamplingParams(temperature=0.0, max_tokens=32)
    ids = [encode_chat(tok, [{"role": "user", "content": p}]) for p in PROMPTS]
    plain = [run_to_end(engine.generate(i, sampling, SpeculativeConfig(method=Method.VANILLA))) for i in ids]
    sd = SpeculativeConfig(method=Method.SD, num_speculative_tokens=16, draft_pool="p")
    picks = ["suffix", "combined-suffix", "suffix"]
    gens = [engine.generate(i, sampling, sd, drafter=d) for i, d in zip(ids, picks, strict=True)]
    run_batch(Batch(embedded, max_batch_size=3, max_batched_tokens=96), {0: gens[:2], 3: gens[2:]})
    for prompt_ids, g, p in zip(ids, gens, plain, strict=True):
        assert_same_tokens(
            embedded, prompt_ids, [t.token_id for t in g.tokens], [t.token_id for t in p.tokens]
        )
        assert g.stats.num_draft_tokens > 0
    assert suffix.global_trees.outputs("p") == len(PROMPTS)
    csd = SpeculativeConfig(method=Method.CSD, num_speculative_tokens=16, draft_pool="p")
    again = run_to_end(engine.generate(ids[0], sampling, csd, drafter="suffix"))
    assert again.finish_reason is not None and again.stats.num_accepted > 0


def test_the_drafter_never_keeps_more_than_the_copy_bound():
    """bench.agentic_replay's copy bound (the longest stretch ahead found anywhere in what the replica has
    seen) is a ceiling for every drafter that copies: the suffix drafter replayed cold and pooled stays under
    it on texts with many repeats, and reaches it where the answer repeats one earlier answer."""
    from bench.agentic_replay import copy_bound, replay

    rng = random.Random(5)

    def turn(i: int) -> dict:
        phrase = [rng.randrange(12) for _ in range(30)]
        answer = phrase[:10] + [rng.randrange(12) for _ in range(8)] + phrase[10:]
        return {"conversation": i, "family": "f", "prompt": [99, *phrase, 98], "output": answer}

    earlier, measured = [turn(i) for i in range(4)], [turn(i) for i in range(4)]
    for prior in ([], earlier):
        drafter = SuffixDrafter()
        replay(drafter, prior, k=16)
        forwards = sum(replay(drafter, measured, k=16)[1])
        assert forwards >= sum(copy_bound(measured, 16, prior)[1])
    same = [{"conversation": 0, "family": "f", "prompt": [1, 2, 3], "output": list(range(100, 140))}]
    drafter = SuffixDrafter()
    replay(drafter, same, k=16)
    again = [{**same[0], "prompt": [4, 2, 3]}]
    assert replay(drafter, again, k=16)[1] == copy_bound(again, 16, same)[1] == [3]
