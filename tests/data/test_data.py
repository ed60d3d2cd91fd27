"""Data tier: tokenizers, corpus harvesting, and the prepare tool.

Round trips (text -> ids -> text, files -> dataset -> files), Megatron's
GPTDataset over the output, idempotency, and one test per bad input. Small
corpora are copies of a few stdlib modules: real text, written in seconds.
"""

import collections
import json
import math
import os
import shlex
import subprocess
import sys
import sysconfig

import numpy
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.tokenizers import MegatronTokenizerBase

from megatron_lrmoe.data import prepare as prepare_mod
from megatron_lrmoe.data.corpus import (
    STDLIB_LICENSE,
    content_sha256,
    harvest,
    parse_extensions,
    stdlib_corpus,
)
from megatron_lrmoe.data.prepare import (
    UnigramHistogram,
    main,
    prepare_dataset,
    unigram_entropy_nats,
)
from megatron_lrmoe.data.tokenizers import (
    ByteLevelTokenizer,
    DataPrepError,
    SentencePieceTokenizer,
    build_tokenizer,
    train_sentencepiece,
)

STDLIB = sysconfig.get_paths()["stdlib"]
SAMPLE_MODULES = ("textwrap.py", "string.py", "heapq.py", "bisect.py", "json/decoder.py")

TRICKY_TEXTS = [
    "",
    " ",
    "  leading and trailing  ",
    "tabs\tand\nnewlines\r\n\n\n",
    "def f(x):\n    return x  # indentation\n",
    "naïve café, 日本語, emoji 🙂, ZWJ 👩‍💻",
    "literal sentencepiece meta symbol \u2581 and \u2581\u2581 twice",
    "control \x01\x7f chars",
]


def _write(path, text: str) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as fh:
        fh.write(text)
    return str(path)


def _sample_corpus(folder) -> dict[str, str]:
    """A few stdlib modules plus hand-written edge cases; returns relpath -> text."""
    texts = {}
    for name in SAMPLE_MODULES:
        with open(os.path.join(STDLIB, name), encoding="utf-8") as fh:
            texts[f"lib/{name}"] = fh.read()
    texts["notes/unicode.txt"] = TRICKY_TEXTS[5] + "\n" + TRICKY_TEXTS[6]
    texts["notes/empty.txt"] = ""
    for rel, text in texts.items():
        _write(os.path.join(folder, rel), text)
    _write(os.path.join(folder, "notes/ignored.log"), "not matched by the extensions")
    return texts


def _stamp(path: str) -> tuple[int, int]:
    st_ = os.stat(path)
    return st_.st_ino, st_.st_mtime_ns


# ------------------------------------------------------------------ tokenizers


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(exclude_categories=())))  # surrogates included
def test_byte_level_round_trip_any_text(text):
    tok = ByteLevelTokenizer()
    ids = tok.tokenize(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.detokenize(ids) == text
    assert tok.detokenize(numpy.asarray(ids + [tok.eod, tok.pad])) == text
    assert tok.tokenize_array(text).tolist() == ids


def test_byte_level_ids_and_megatron_fields():
    tok = ByteLevelTokenizer()
    assert (tok.vocab_size, tok.eod, tok.pad, tok.eos) == (258, 256, 257, 256)
    assert tok.tokenize("Aé") == [0x41, 0xC3, 0xA9]
    assert len(tok.vocab) == len(tok.inv_vocab) == tok.vocab_size
    assert tok.unique_identifiers["class"] == "ByteLevelTokenizer"
    assert tok.unique_identifiers["tokenizer_path"] == []
    assert isinstance(tok, MegatronTokenizerBase)   # what GPTDatasetConfig.tokenizer is typed as
    # A cut through a multi-byte character decodes with a replacement char.
    assert tok.detokenize([0x41, 0xC3]) == "A\ufffd"
    assert tok.detokenize(tok.tokenize("lone \ud800 surrogate")) == "lone \ud800 surrogate"


@pytest.fixture(scope="module")
def sp_files(tmp_path_factory) -> list[str]:
    folder = tmp_path_factory.mktemp("spm_corpus")
    return [str(folder / rel) for rel in sorted(_sample_corpus(folder))]


@pytest.fixture(scope="module")
def sp_model(sp_files, tmp_path_factory) -> str:
    return train_sentencepiece(sp_files, str(tmp_path_factory.mktemp("spm") / "tok"), 600)


def test_sentencepiece_round_trip(sp_model):
    tok = SentencePieceTokenizer(sp_model)
    assert (tok.eod, tok.pad) == (1, 2)
    assert tok.vocab_size <= 600
    for text in TRICKY_TEXTS:
        ids = tok.tokenize(text)
        assert tok.eod not in ids and tok.pad not in ids
        assert tok.detokenize(ids + [tok.eod]) == text
    with open(os.path.join(STDLIB, "textwrap.py"), encoding="utf-8") as fh:
        source = fh.read()
    ids = tok.tokenize(source)
    assert tok.detokenize(ids) == source
    assert len(ids) < len(source.encode()) / 2  # it did learn pieces


@settings(max_examples=100, deadline=None)
@given(text=st.text())
def test_sentencepiece_round_trip_any_text(sp_model, text):
    tok = SentencePieceTokenizer(sp_model)
    assert tok.detokenize(tok.tokenize(text)) == text


def test_cli_in_a_fresh_process_trains_the_same_model(sp_files, sp_model, tmp_path):
    # A fresh interpreter: sentencepiece's own sampler was seeded per process,
    # so only a second process shows whether training is reproducible.
    # Also covers `python -m` end to end.
    root = os.path.commonpath(sp_files)
    prefix = str(tmp_path / "ds")
    argv = ["--input", root, "--output-prefix", prefix, "--train-sentencepiece-vocab", "600"]
    run = subprocess.run(
        [sys.executable, "-m", "megatron_lrmoe.data.prepare", *argv],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "wrote" in run.stdout
    with open(sp_model, "rb") as a, open(prefix + ".model", "rb") as b:
        assert a.read() == b.read()
    with open(prefix + ".meta.json") as fh:
        meta = json.load(fh)
    assert meta["num_documents"] == len(sp_files)
    assert meta["command"] == shlex.join(
        [sys.executable, "-m", "megatron_lrmoe.data.prepare", *argv]
    )


def test_build_tokenizer_flags(sp_model):
    assert isinstance(build_tokenizer(), ByteLevelTokenizer)
    tok = build_tokenizer("SentencePieceTokenizer", sp_model)
    assert isinstance(tok, SentencePieceTokenizer)
    with pytest.raises(ValueError, match="--tokenizer-type.*ByteLevelTokenizer.*SentencePiece"):
        build_tokenizer("GPT2BPETokenizer")
    with pytest.raises(ValueError, match="--tokenizer-model"):
        build_tokenizer("SentencePieceTokenizer")
    with pytest.raises(ValueError, match="/nowhere/x.model.*--tokenizer-model"):
        build_tokenizer("SentencePieceTokenizer", "/nowhere/x.model")


# ------------------------------------------------------------------ histogram


def test_unigram_histogram_counts_every_token_exactly():
    # Oracle: a Counter over the tokens as Python ints, and the entropy by its formula.
    rng = numpy.random.default_rng(0)
    hist = UnigramHistogram(11)
    chunks = [rng.integers(0, 11, n).astype(numpy.uint16) for n in (0, 1, 5, 30, 64)]
    for chunk in chunks:
        hist.add(chunk)
    counter = collections.Counter(int(t) for chunk in chunks for t in chunk)
    assert hist.counts.tolist() == [counter[v] for v in range(11)]
    total = sum(counter.values())
    expected = -sum(c / total * math.log(c / total) for c in counter.values())
    assert hist.entropy_nats() == pytest.approx(expected, rel=1e-12)


def test_unigram_entropy_values():
    assert unigram_entropy_nats(numpy.zeros(4, dtype=numpy.int64)) == 0.0
    assert unigram_entropy_nats(numpy.array([5, 0, 0])) == 0.0
    assert unigram_entropy_nats(numpy.array([3, 3, 3, 3])) == pytest.approx(numpy.log(4))


# ------------------------------------------------------------------ prepare


def test_prepare_round_trip_byte_level(tmp_path):
    texts = _sample_corpus(tmp_path / "in")
    prefix = str(tmp_path / "out" / "ds")
    meta = prepare_dataset([str(tmp_path / "in")], prefix, extensions=".py,.txt", log=None)

    tok = ByteLevelTokenizer()
    ds = IndexedDataset(prefix)
    rels = sorted(texts)  # documents are in relative-path order
    assert len(ds) == meta["num_documents"] == len(rels)
    assert ds.document_indices.tolist() == list(range(len(rels) + 1))
    all_ids = []
    for i, rel in enumerate(rels):
        doc = ds[i]
        assert doc.dtype == numpy.uint16
        assert doc[-1] == tok.eod and tok.eod not in doc[:-1]
        assert tok.detokenize(doc) == texts[rel]
        all_ids.append(doc)
    all_ids = numpy.concatenate(all_ids)

    assert meta["num_tokens"] == all_ids.size == sum(len(t.encode()) + 1 for t in texts.values())
    assert meta["total_bytes"] == sum(len(t.encode()) for t in texts.values())
    assert meta["bin_bytes"] == os.path.getsize(prefix + ".bin") == 2 * all_ids.size
    assert meta["unigram_entropy_nats"] == pytest.approx(
        unigram_entropy_nats(numpy.bincount(all_ids, minlength=tok.vocab_size))
    )
    assert meta["tokenizer"] == tok.describe() | {"trained_vocab": None}
    assert meta["source"]["root"] == str(tmp_path / "in")
    assert meta["source"]["num_files"] == len(rels)
    assert "prepare" in meta["command"] and "--extensions .py,.txt" in meta["command"]
    with open(prefix + ".meta.json") as fh:
        assert json.load(fh) == meta
    assert not [p for p in os.listdir(tmp_path / "out") if "partial" in p]


def test_prepare_reads_gzip_compressed_documents(tmp_path):
    # Manual pages (a second real corpus on these machines) are stored gzip-compressed.
    import gzip

    texts = {"man1/ls.1.gz": ".TH LS 1\nlist directory contents\n",
             "man5/passwd.5.gz": ".TH PASSWD 5\nthe password file \u00e9\n"}
    for rel, text in texts.items():
        (tmp_path / "in" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "in" / rel).write_bytes(gzip.compress(text.encode()))
    (tmp_path / "in" / "man1" / "broken.1.gz").write_bytes(b"not gzip")
    prefix = str(tmp_path / "out" / "ds")
    with pytest.raises(DataPrepError, match=r"broken\.1\.gz ends in \.gz but is not gzip"):
        prepare_dataset([str(tmp_path / "in")], prefix, extensions=".gz", log=None)
    (tmp_path / "in" / "man1" / "broken.1.gz").unlink()
    meta = prepare_dataset([str(tmp_path / "in")], prefix, extensions=".gz", log=None)
    ds, tok = IndexedDataset(prefix), ByteLevelTokenizer()
    assert [tok.detokenize(ds[i]) for i in range(len(ds))] == [texts[r] for r in sorted(texts)]
    assert meta["num_tokens"] == sum(len(t.encode()) + 1 for t in texts.values())


def test_prepare_trains_sentencepiece(tmp_path):
    texts = _sample_corpus(tmp_path / "in")
    prefix = str(tmp_path / "ds")
    meta = prepare_dataset(
        [str(tmp_path / "in")], prefix, train_sentencepiece_vocab=500, workers=2, log=None
    )
    assert meta["tokenizer"]["type"] == "SentencePieceTokenizer"
    assert meta["tokenizer"]["model"] == prefix + ".model"
    tok = SentencePieceTokenizer(prefix + ".model")
    ds = IndexedDataset(prefix)
    for i, rel in enumerate(sorted(texts)):
        assert ds[i][-1] == tok.eod
        assert tok.detokenize(ds[i]) == texts[rel]
    # Up to date: the model is not retrained, nothing is rewritten.
    before = [_stamp(prefix + ext) for ext in (".model", ".bin", ".idx", ".meta.json")]
    prepare_dataset([str(tmp_path / "in")], prefix, train_sentencepiece_vocab=500, log=None)
    assert [_stamp(prefix + ext) for ext in (".model", ".bin", ".idx", ".meta.json")] == before


def test_gpt_dataset_over_prepared_data(tmp_path):
    _sample_corpus(tmp_path / "in")
    prefix = str(tmp_path / "ds")
    prepare_dataset([str(tmp_path / "in")], prefix, log=None)
    tok = build_tokenizer("ByteLevelTokenizer")
    config = GPTDatasetConfig(
        random_seed=1234,
        sequence_length=32,
        blend=([prefix], None),
        split="90,10,0",
        tokenizer=tok,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=str(tmp_path / "cache"),
    )
    train, valid, test = BlendedMegatronDatasetBuilder(
        GPTDataset, [16, 4, None], lambda: True, config
    ).build()
    assert test is None and len(train) >= 16 and len(valid) >= 4
    sample = train[0]
    assert sample["tokens"].shape == sample["labels"].shape == sample["loss_mask"].shape == (32,)
    assert sample["tokens"].dtype == torch.int64
    assert int(sample["tokens"].max()) < tok.vocab_size
    # labels are the tokens shifted by one
    assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])


def test_prepare_is_idempotent_and_force_rewrites(tmp_path, capsys):
    _sample_corpus(tmp_path / "in")
    prefix = str(tmp_path / "ds")
    argv = ["--input", str(tmp_path / "in"), "--output-prefix", prefix]
    assert main(argv) == 0
    files = [prefix + ext for ext in (".bin", ".idx", ".meta.json")]
    before = [_stamp(p) for p in files]
    capsys.readouterr()

    assert main(argv) == 0
    assert "up to date" in capsys.readouterr().out
    assert [_stamp(p) for p in files] == before

    assert main([*argv, "--force"]) == 0
    after = [_stamp(p) for p in files]
    assert all(a != b for a, b in zip(after, before, strict=True))
    with open(prefix + ".meta.json") as fh:
        assert json.load(fh)["command"].endswith(" ".join(argv) + " --force")


def test_prepare_rebuilds_when_a_file_changes(tmp_path):
    _sample_corpus(tmp_path / "in")
    target = tmp_path / "in" / "notes" / "unicode.txt"
    prefix = str(tmp_path / "ds")
    first = prepare_dataset([str(tmp_path / "in")], prefix, log=None)

    # Same size, different content: the file-list hash stays, the content hash moves.
    original = target.read_bytes()
    target.write_bytes(b"X" + original[1:])
    corpus = harvest([str(tmp_path / "in")])
    assert corpus.file_list_sha256 == first["source"]["file_list_sha256"]
    assert content_sha256(corpus) != first["source"]["content_sha256"]
    second = prepare_dataset([str(tmp_path / "in")], prefix, log=None)
    assert second["source"]["content_sha256"] != first["source"]["content_sha256"]

    # Different size: the file-list hash moves too.
    target.write_bytes(original + b"more")
    third = prepare_dataset([str(tmp_path / "in")], prefix, log=None)
    assert third["source"]["file_list_sha256"] != first["source"]["file_list_sha256"]
    assert third["num_tokens"] == first["num_tokens"] + 4


def test_failed_rebuild_keeps_old_dataset(tmp_path, monkeypatch):
    _sample_corpus(tmp_path / "in")
    prefix = str(tmp_path / "ds")
    prepare_dataset([str(tmp_path / "in")], prefix, log=None)
    before = [_stamp(prefix + ext) for ext in (".bin", ".idx", ".meta.json")]

    def crash(self, tokens):
        raise RuntimeError("simulated crash mid-build")

    monkeypatch.setattr(UnigramHistogram, "add", crash)
    with pytest.raises(RuntimeError, match="simulated"):
        prepare_dataset([str(tmp_path / "in")], prefix, force=True, log=None)
    assert [_stamp(prefix + ext) for ext in (".bin", ".idx", ".meta.json")] == before
    assert sorted(os.listdir(tmp_path)) == ["ds.bin", "ds.idx", "ds.meta.json", "in"]
    assert len(IndexedDataset(prefix)) == 7


def test_explicit_files_and_input_order(tmp_path):
    a = _write(tmp_path / "b" / "a.weird", "alpha")
    b = _write(tmp_path / "a" / "b.txt", "beta")
    meta1 = prepare_dataset([a, b], str(tmp_path / "one"), log=None)
    meta2 = prepare_dataset([b, a, a], str(tmp_path / "two"), log=None)
    assert meta1["num_documents"] == meta2["num_documents"] == 2
    assert meta1["source"]["file_list_sha256"] == meta2["source"]["file_list_sha256"]
    with open(tmp_path / "one.bin", "rb") as x, open(tmp_path / "two.bin", "rb") as y:
        assert x.read() == y.read()
    ds = IndexedDataset(str(tmp_path / "one"))  # keep it alive: items are views of its mmap
    assert ByteLevelTokenizer().detokenize(ds[0]) == "beta"


def test_parse_extensions():
    assert parse_extensions(".py, TXT,,py") == (".py", ".txt")
    assert parse_extensions(["md"]) == (".md",)
    with pytest.raises(DataPrepError, match="--extensions"):
        parse_extensions(" , ")


# ------------------------------------------------------------------ bad input


def _error(tmp_path, inputs, prefix=None, **kwargs) -> str:
    with pytest.raises(DataPrepError) as info:
        prepare_dataset(inputs, prefix or str(tmp_path / "out" / "ds"), log=None, **kwargs)
    assert not os.path.exists(tmp_path / "out" / "ds.idx")
    return str(info.value)


def test_error_missing_path(tmp_path):
    missing = str(tmp_path / "nope")
    msg = _error(tmp_path, [missing])
    assert missing in msg and "--input" in msg


def test_error_empty_folder_and_no_matching_extension(tmp_path):
    os.makedirs(tmp_path / "empty")
    msg = _error(tmp_path, [str(tmp_path / "empty")])
    assert str(tmp_path / "empty") in msg and "--extensions" in msg
    _write(tmp_path / "logs" / "x.log", "text")
    msg = _error(tmp_path, [str(tmp_path / "logs")], extensions=".py")
    assert str(tmp_path / "logs") in msg and ".py" in msg and "--extensions" in msg


def test_error_binary_file_given_explicitly(tmp_path):
    path = tmp_path / "blob.txt"
    path.write_bytes(b"abc\0def")
    msg = _error(tmp_path, [str(path)])
    assert str(path) in msg and "NUL" in msg and "--input" in msg


def test_binary_files_found_in_folders_are_skipped_and_reported(tmp_path):
    # A folder walk skips what is not UTF-8 text (a Latin-1 header, a NUL byte), says how
    # many and which, and records them; the same file named in --input still stops the run.
    _write(tmp_path / "in" / "good.txt", "fine")
    bad = tmp_path / "in" / "sub" / "latin1.txt"
    bad.parent.mkdir()
    bad.write_bytes("caf\u00e9".encode("latin-1"))
    (tmp_path / "in" / "nul.txt").write_bytes(b"abc\0def")
    lines = []
    meta = prepare_dataset([str(tmp_path / "in")], str(tmp_path / "ok" / "ds"), log=lines.append)
    assert meta["num_documents"] == 1
    assert meta["source"]["skipped"] == ["nul.txt", os.path.join("sub", "latin1.txt")]
    (report,) = [line for line in lines if line.startswith("skipped")]
    assert "skipped 2 file(s)" in report and "latin1.txt" in report
    msg = _error(tmp_path, [str(bad)])
    assert str(bad) in msg and "UTF-8" in msg and "--input" in msg
    # A walk that finds no text at all says so.
    os.remove(tmp_path / "in" / "good.txt")
    msg = _error(tmp_path, [str(tmp_path / "in")], force=True)
    assert "none of the 2 files" in msg and "--extensions" in msg


def test_error_unwritable_output(tmp_path):
    _write(tmp_path / "in.txt", "text")
    blocker = _write(tmp_path / "file", "a file where a folder should be")
    msg = _error(tmp_path, [str(tmp_path / "in.txt")], prefix=os.path.join(blocker, "ds"))
    assert blocker in msg and "--output-prefix" in msg


def test_error_too_little_text(tmp_path):
    _write(tmp_path / "in" / "a.txt", "")
    _write(tmp_path / "in" / "b.txt", "")
    msg = _error(tmp_path, [str(tmp_path / "in")])
    assert str(tmp_path / "in") in msg and "empty" in msg
    _write(tmp_path / "in" / "c.txt", "short")
    msg = _error(tmp_path, [str(tmp_path / "in")], min_tokens=100)
    assert str(tmp_path / "in") in msg and "5 text tokens" in msg


def test_error_tokenizer_flag_conflicts(tmp_path, sp_model):
    _write(tmp_path / "in.txt", "text")
    inputs = [str(tmp_path / "in.txt")]
    msg = _error(tmp_path, inputs, train_sentencepiece_vocab=500, tokenizer_model=sp_model)
    assert "--tokenizer-model" in msg
    msg = _error(tmp_path, [str(tmp_path / "in.txt")], tokenizer_type="Nope")
    assert "--tokenizer-type" in msg


def test_cli_prints_error_and_exits_2(tmp_path, capsys):
    missing = str(tmp_path / "nope")
    assert main(["--input", missing, "--output-prefix", str(tmp_path / "ds")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and missing in err and "Traceback" not in err


# ------------------------------------------------------------------ default corpus


def test_default_corpus_harvest():
    corpus = stdlib_corpus()
    assert len(corpus.files) > 500
    assert corpus.total_bytes >= 10 * 1024 * 1024
    assert corpus.root == STDLIB and corpus.license == STDLIB_LICENSE
    parts = {part for f in corpus.files for part in f.relpath.split(os.sep)}
    assert not parts & {"site-packages", "dist-packages", "__pycache__"}
    assert all(f.relpath.endswith(".py") for f in corpus.files)
    assert [f.relpath for f in corpus.files] == sorted(f.relpath for f in corpus.files)
    assert "os.py" in {f.relpath for f in corpus.files}
    # The stdlib's deliberately non-UTF-8 encoding tests are skipped, not fatal.
    assert all(r.endswith(".py") for r in corpus.skipped)


def test_default_corpus_used_without_inputs(tmp_path, monkeypatch):
    # Tokenizing all 30 MB is left to the timing run; a 3-file slice of the
    # same harvest proves the wiring (license, root, default flag).
    full = stdlib_corpus()
    small = type(full)(root=full.root, files=full.files[:3], license=full.license)
    monkeypatch.setattr(prepare_mod, "stdlib_corpus", lambda: small)
    meta = prepare_dataset(None, str(tmp_path / "ds"), log=None)
    assert meta["source"]["default_corpus"] is True
    assert meta["license"] == STDLIB_LICENSE
    assert meta["num_documents"] == 3
    assert "--input" not in meta["command"]
