"""Model loading: the GGUF conversion cache, local folders, and clear errors for what cannot be loaded."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from service.decoding import DecodingError, check_same_vocabulary, load_model
from service.executor.cpu_kernels import has_native_bf16
from service.executor.models import gguf_cache_folder, gguf_content_key, load_tokenizer_for_display
from service.executor.paths import default_cache_dir, embedded_gguf_path
from tests.conftest import WORDS, make_word_model, make_word_tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def words():
    return make_word_model(seed=0)


@pytest.fixture(scope="module")
def saved_words(words, tmp_path_factory):
    """The tiny word model saved as a Hugging Face folder (config.json, safetensors, tokenizer)."""
    folder = tmp_path_factory.mktemp("words-model")
    words.model.save_pretrained(folder)
    words.tokenizer.save_pretrained(folder)
    return folder


def logits(model, ids):
    with torch.inference_mode():
        return model.model(input_ids=torch.tensor([ids])).logits[0].float()


# ---------------------------------------------------------------- the GGUF conversion cache


def test_second_load_of_the_embedded_gguf_reuses_the_converted_folder(embedded):
    """The `embedded` fixture has loaded (and, on a fresh machine, converted) the GGUF file once; going
    through the GGUF path again must find the converted folder, not convert again: no file in it is
    rewritten. (That load_model then reads that folder is the next test.)"""
    folder = gguf_cache_folder(embedded_gguf_path(), default_cache_dir())
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert json.loads((folder / "csd_source.json").read_text())["key"] == embedded.revision
    assert embedded.revision in folder.name
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    tokenizer = load_tokenizer_for_display("embedded")
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before
    assert tokenizer.get_vocab() == embedded.tokenizer.get_vocab()


def test_a_copy_of_the_gguf_elsewhere_reuses_the_same_converted_folder(embedded, tmp_path):
    """Issue 13, finding 10: every virtual environment holds its own copy of the package's GGUF file (another
    path, another mtime). The cache is keyed by content, so a copy finds the folder the original converted,
    and the OCM namespace (the revision) is the same too."""
    copy = tmp_path / "other-venv" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    copy.parent.mkdir()
    shutil.copyfile(embedded_gguf_path(), copy)  # a new file: new inode, new mtime
    cache = default_cache_dir()
    folder = gguf_cache_folder(embedded_gguf_path(), cache)
    assert gguf_cache_folder(copy, cache) == folder
    before = sorted(p.name for p in (cache / "models").iterdir())
    assert load_tokenizer_for_display(str(copy)).get_vocab() == embedded.tokenizer.get_vocab()
    assert sorted(p.name for p in (cache / "models").iterdir()) == before  # nothing converted anew
    assert gguf_content_key(copy, cache) == embedded.revision


def test_a_changed_file_gets_a_new_key(tmp_path):
    """The digest memo is keyed by path, size and mtime: rewriting a file in place is hashed afresh."""
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF one")
    first = gguf_content_key(f, tmp_path)
    f.write_bytes(b"GGUF two, longer")
    assert gguf_content_key(f, tmp_path) != first
    g = tmp_path / "copy.gguf"
    g.write_bytes(b"GGUF one")
    assert gguf_content_key(g, tmp_path) == first


def test_a_prepared_cache_folder_is_loaded_instead_of_the_gguf(saved_words, tmp_path):
    """Whatever sits in the cache folder of a GGUF file is what loads: put the tiny word model there and
    `embedded` comes back with its 12-word vocabulary, without the GGUF file ever being converted."""
    folder = gguf_cache_folder(embedded_gguf_path(), tmp_path)
    folder.parent.mkdir(parents=True)
    folder.symlink_to(saved_words, target_is_directory=True)
    loaded = load_model("embedded", cache_dir=tmp_path)
    assert loaded.model.config.vocab_size == len(WORDS)
    assert [p.name for p in (tmp_path / "models").iterdir()] == [folder.name]


# ---------------------------------------------------------------- local folders


def test_a_saved_folder_loads_the_same_model(words, saved_words):
    loaded = load_model(str(saved_words), dtype="float32")
    assert loaded.name == str(saved_words) and loaded.revision == "local"
    assert loaded.tokenizer.get_vocab() == words.tokenizer.get_vocab()
    ids = [2, 3, 4, 5, 6]
    torch.testing.assert_close(logits(loaded, ids), logits(words, ids), atol=1e-6, rtol=0)


def test_dtype_is_applied_and_validated(saved_words):
    assert load_model(str(saved_words), dtype="bfloat16").model.dtype == torch.bfloat16
    assert load_model(str(saved_words), dtype="float32").model.dtype == torch.float32
    # auto on the CPU: bf16 where the CPU multiplies bf16 natively (AVX512-BF16, AMX, Arm BF16), else fp32
    native = torch.bfloat16 if has_native_bf16() else torch.float32
    assert load_model(str(saved_words)).model.dtype == native
    for bad in ("float64", "int8", ""):
        with pytest.raises(DecodingError, match="unknown dtype") as info:
            load_model(str(saved_words), dtype=bad)
        assert "float32" in str(info.value)  # says what would be accepted


@pytest.mark.parametrize(
    "caps",
    [
        {"ONEDNN_MAX_CPU_ISA": "AVX2"},
        {"ONEDNN_MAX_CPU_ISA": "avx512_core"},
        {"DNNL_MAX_CPU_ISA": "AVX2"},
        {"ATEN_CPU_CAPABILITY": "avx2"},
    ],
)
def test_a_dispatch_capped_below_bf16_loads_fp32(saved_words, monkeypatch, caps):
    """Under a cap (how `make test` runs the decoding tests a second time) a CPU with AMX or AVX512-BF16
    takes the path AVX2-only CPUs take: fp32, packed weights."""
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in caps.items():
        monkeypatch.setenv(name, value)
    assert not has_native_bf16()
    assert load_model(str(saved_words)).model.dtype == torch.float32


def test_a_cap_that_allows_bf16_changes_nothing(monkeypatch):
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY"):
        monkeypatch.delenv(name, raising=False)
    native = has_native_bf16()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert has_native_bf16() == native


def test_an_unknown_device_is_refused(saved_words):
    with pytest.raises(DecodingError, match="device 'gpu-9'"):
        load_model(str(saved_words), device="gpu-9")


# ---------------------------------------------------------------- what cannot be loaded


def test_a_file_that_is_not_gguf_is_refused_before_anything_is_cached(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_text("this is not a model\n")
    cache = tmp_path / "cache"
    with pytest.raises(DecodingError, match="is not a GGUF file") as info:
        load_model(str(fake), cache_dir=cache)
    assert str(fake) in str(info.value)
    assert not (cache / "models").exists() or not any((cache / "models").iterdir())


def test_a_broken_gguf_file_is_refused_in_one_line(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(range(256)) * 4)  # the magic, then garbage
    cache = tmp_path / "cache"
    with pytest.raises(DecodingError, match="cannot load GGUF file") as info:
        load_model(str(broken), cache_dir=cache)
    assert "\n" not in str(info.value)
    leftovers = list((cache / "models").iterdir()) if (cache / "models").exists() else []
    assert leftovers == []  # no half-written cache folder


@pytest.mark.parametrize(
    "spec, message",
    [
        ("/nonexistent/dir/model.gguf", "does not exist"),
        ("./no-such-model-folder", "does not exist"),
        ("~/no-such-model.gguf", "does not exist"),
        ("no-such-org/no-such-model", "cannot load model 'no-such-org/no-such-model'"),
    ],
)
def test_a_missing_model_gives_a_clear_error(spec, message):
    with pytest.raises(DecodingError, match=message) as info:
        load_model(spec)
    assert "\n" not in str(info.value)


def test_folders_without_exactly_one_model_are_refused(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DecodingError, match="neither a config.json nor a .gguf file"):
        load_model(str(empty))
    several = tmp_path / "several"
    several.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (several / name).write_bytes(b"GGUF")
    with pytest.raises(DecodingError, match="several .gguf files"):
        load_model(str(several))
    one = tmp_path / "one"
    one.mkdir()
    (one / "model.gguf").write_text("not gguf")
    with pytest.raises(DecodingError, match="is not a GGUF file"):
        load_model(str(one), cache_dir=tmp_path / "cache")


# ---------------------------------------------------------------- draft vocabulary


def test_a_draft_with_another_vocabulary_is_refused_naming_both(words):
    other_words = make_word_tokenizer(WORDS[:2] + ("le", "chat", "est", "sur", "un", "tapis"))
    draft = make_word_model(seed=1, tokenizer=other_words)
    with pytest.raises(DecodingError) as info:
        check_same_vocabulary(words, draft)
    assert words.name in str(info.value) and draft.name in str(info.value)
    # same words, other ids: token ids are not comparable either
    shuffled = make_word_tokenizer(WORDS[:2] + tuple(reversed(WORDS[2:])))
    with pytest.raises(DecodingError, match="vocabulary"):
        check_same_vocabulary(words, make_word_model(seed=2, tokenizer=shuffled))
    # a draft with the very same tokenizer is fine
    check_same_vocabulary(words, make_word_model(seed=3, tokenizer=words.tokenizer))


# ---------------------------------------------------------------- oneDNN-packed CPU weights


def test_packed_cpu_weights_give_the_default_kernels_logits():
    """`load_model` packs an fp32 CPU model's linear layers for oneDNN; the logits stay those of the
    default kernels to float32 rounding, for one token and for several (the speculative shapes), and the
    greedy choice is the same at every position."""
    from service.executor.batch_invariant import FP32LogitsHead
    from service.executor.cpu_kernels import PackedLinear

    packed = load_model("embedded", dtype="float32")
    dense = load_model("embedded", dtype="float32", pack_cpu_weights=False)
    assert not any(isinstance(m, PackedLinear) for m in dense.model.modules())
    assert any(isinstance(m, PackedLinear) for m in packed.model.modules())
    assert not any(type(m) is torch.nn.Linear for m in packed.model.modules())
    ids = packed.tokenizer("The colour of the theatre was grey, and the centre stage of the")["input_ids"]
    for rows in (ids[:1], ids):
        packed_logits, dense_logits = logits(packed, rows), logits(dense, rows)
        torch.testing.assert_close(packed_logits, dense_logits, atol=1e-3, rtol=0)
        assert torch.equal(packed_logits.argmax(-1), dense_logits.argmax(-1))
    # code that inspects the output projection still sees a dense [vocab, hidden] weight
    head = packed.model.get_output_embeddings()
    assert tuple(head.weight.shape) == (len(packed.tokenizer), packed.model.config.hidden_size)
    # a bf16 model's body is not packed (oneDNN packing is the fp32 path); the one packed layer a bf16 CPU
    # model may have is the fp32 copy inside its fp32 LM head (batch_invariant.FP32LogitsHead)
    bf16 = load_model("embedded", dtype="bf16").model
    packed_layers = [name for name, m in bf16.named_modules() if isinstance(m, PackedLinear)]
    head_layers = [f"{name}.packed" for name, m in bf16.named_modules() if isinstance(m, FP32LogitsHead)]
    assert packed_layers == head_layers


def test_a_packed_layer_gives_a_row_the_same_bits_in_every_call_of_2_to_64_rows():
    """Packed for PACKED_FOR_ROWS rows, oneDNN still sums a row the same way in any call of 2 to 64 rows
    (what FP32LogitsHead's row blocks rely on), and its output is the layer's to fp32 rounding."""
    from service.executor.cpu_kernels import PackedLinear

    torch.manual_seed(5)
    linear = torch.nn.Linear(576, 1536)
    packed = PackedLinear(linear)
    rows = torch.randn(64, 576)
    with torch.inference_mode():
        pairs = torch.cat([packed(row[None].expand(2, -1))[:1] for row in rows])
        for count in (2, 3, 8, 9, 33, 64):
            assert torch.equal(packed(rows[:count]), pairs[:count]), count
        torch.testing.assert_close(packed(rows), linear(rows), atol=1e-4, rtol=0)


def test_a_loaded_model_tracks_no_gradients():
    # served weights never train; activations that tracked gradients sent oneDNN's packed linear through
    # autograd's fallback (a one-token forward took 4 s instead of 60 ms under an AVX2 dispatch)
    loaded = load_model("embedded", dtype="float32")
    assert not any(p.requires_grad for p in loaded.model.parameters())
    ids = torch.tensor([loaded.tokenizer("Hello there")["input_ids"]])
    assert not loaded.model(ids).logits.requires_grad


def test_models_that_are_not_fp32_on_the_cpu_are_not_packed():
    from service.executor.cpu_kernels import pack_linear_layers

    half = make_word_model(seed=1).model.to(torch.bfloat16)
    assert pack_linear_layers(half) == 0
    assert any(type(m) is torch.nn.Linear for m in half.modules())


def test_the_gguf_conversion_draws_no_progress_bar(capfd):
    # transformers' GGUF reader calls tqdm.auto itself; on a fresh cache its bar was an unstamped line in the
    # server's log (tests/api/test_http.py checks every line is stamped, on a machine whose cache is empty)
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from service.executor.models import _quiet_gguf_progress

    original = gguf_utils.tqdm
    with _quiet_gguf_progress():
        for _ in gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
            pass
    assert "Converting" not in capfd.readouterr().err
    assert gguf_utils.tqdm is original
