"""Tokenize a text corpus into a Megatron indexed dataset (PREFIX.bin / .idx / .meta.json).

    python -m megatron_lrmoe.data.prepare --output-prefix data/stdlib
    python -m megatron_lrmoe.data.prepare --input docs/ notes.txt --output-prefix data/docs \\
        --train-sentencepiece-vocab 8000 --extensions .md,.txt

One document per file, eod appended, documents in sorted path order. Without
--input the corpus is the running interpreter's standard library (.py files).

Pipeline (each stage a function below):
    harvest      inputs -> sorted file list (corpus.py)
    scan         read every file once: reject binaries, hash contents
    up-to-date?  meta.json says same files, same contents, same tokenizer -> done
    tokenizer    build it (training a sentencepiece model first if asked)
    encode       chunks of files -> worker pool -> token arrays, eod appended
    write        IndexedDatasetBuilder on temporary names + unigram histogram
    commit       fsync, then os.replace into place; meta.json last

Memory stays bounded by CHUNK_BYTES of text (plus the index's per-document
lengths), whatever the corpus size.
"""

import argparse
import json
import multiprocessing
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

if __name__ == "__main__":
    # The command line: megatron.core's known benign notices fire at import, so hide them
    # first (integration/runtime/cpu.py, quiet_known_warnings; the package imports nothing
    # of Megatron).
    from megatron_lrmoe.integration.runtime.cpu import (
        quiet_known_warnings,
        skip_torch_compile_of_functions,
    )

    quiet_known_warnings()
    skip_torch_compile_of_functions()

import megatron.core  # noqa: E402
import numpy  # noqa: E402
from megatron.core.datasets.indexed_dataset import (  # noqa: E402
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
)

from megatron_lrmoe.data.corpus import (  # noqa: E402
    Corpus,
    DataPrepError,
    content_sha256,
    harvest,
    parse_extensions,
    read_text,
    stdlib_corpus,
    without_undecodable,
)
from megatron_lrmoe.data.tokenizers import build_tokenizer, train_sentencepiece  # noqa: E402

META_FORMAT = "megatron-lrmoe-dataset/1"

# Text handed to the worker pool per round; with its tokens this keeps the peak
# near 100 MB for any corpus size.
CHUNK_BYTES = 8 << 20

# Tokenizers that run at memory speed: shipping their ids back from a worker
# costs more than encoding them in place (31 MB of stdlib: 0.9 s with 2
# workers against 0.45 s without), so they never use the pool.
_MEMORY_SPEED_TOKENIZERS = frozenset({"ByteLevelTokenizer"})


def meta_path(prefix: str) -> str:
    return prefix + ".meta.json"


def token_dtype(vocab_size: int) -> type[numpy.integer]:
    """uint16 when every id fits, else int32: the rule GPTDatasetConfig uses for its dtype code."""
    return numpy.uint16 if vocab_size <= numpy.iinfo(numpy.uint16).max + 1 else numpy.int32


def default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


# ------------------------------------------------------------------ unigram histogram


class UnigramHistogram:
    """Token counts over the whole corpus, accumulated chunk by chunk (exact int64)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.reset()

    def reset(self) -> None:
        self.counts = numpy.zeros(self.vocab_size, dtype=numpy.int64)

    def add(self, tokens: numpy.ndarray) -> None:
        self.counts += numpy.bincount(tokens, minlength=self.vocab_size)[: self.vocab_size]

    def entropy_nats(self) -> float:
        """-sum p log p over the unigram distribution (0 for an empty histogram)."""
        return unigram_entropy_nats(self.counts)


def unigram_entropy_nats(counts: numpy.ndarray) -> float:
    """Entropy in nats of the distribution proportional to `counts`.

    It is the loss of the best model that ignores context, i.e. the baseline
    per-token cross-entropy a language model trained on this data must beat.
    """
    total = int(counts.sum())
    if total == 0:
        return 0.0
    p = counts[counts > 0].astype(numpy.float64) / total
    return float(-(p * numpy.log(p)).sum())


# ------------------------------------------------------------------ encoding (worker side)


class _DocumentEncoder:
    """file -> token ids of its text with eod appended, in the dataset dtype."""

    def __init__(self, tokenizer_type: str, tokenizer_model: str | None) -> None:
        self.tokenizer = build_tokenizer(tokenizer_type, tokenizer_model)
        self.dtype = token_dtype(self.tokenizer.vocab_size)

    def __call__(self, task: tuple[str, bool]) -> numpy.ndarray:
        path, found_in_folder = task
        ids = self.tokenizer.tokenize_array(read_text(path, found_in_folder))
        doc = numpy.empty(ids.size + 1, dtype=self.dtype)
        doc[:-1] = ids
        doc[-1] = self.tokenizer.eod
        return doc


_worker_encoder: _DocumentEncoder | None = None


def _init_worker(tokenizer_type: str, tokenizer_model: str | None) -> None:
    # Each worker builds its own tokenizer: a sentencepiece processor does not pickle.
    global _worker_encoder
    _worker_encoder = _DocumentEncoder(tokenizer_type, tokenizer_model)


def _encode_in_worker(task: tuple[str, bool]) -> numpy.ndarray:
    return _worker_encoder(task)


def _chunks(corpus: Corpus, chunk_bytes: int) -> list[list[tuple[str, bool]]]:
    """Consecutive runs of files holding about chunk_bytes of text (at least one file each)."""
    chunks, current, size = [], [], 0
    for f in corpus.files:
        current.append((f.path, f.path in corpus.walked))
        size += f.size
        if size >= chunk_bytes:
            chunks.append(current)
            current, size = [], 0
    if current:
        chunks.append(current)
    return chunks


# ------------------------------------------------------------------ output files


def _check_output_dir(prefix: str) -> None:
    """Create the output folder and prove it is writable, before any expensive work."""
    out_dir = os.path.dirname(prefix)
    try:
        os.makedirs(out_dir, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=out_dir, prefix=".lrmoe-write-probe-")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise DataPrepError(
            f"cannot write to output folder {out_dir} ({e.strerror or e}); "
            f"choose another --output-prefix"
        ) from e


def _final_paths(prefix: str) -> dict[str, str]:
    return {"bin": get_bin_path(prefix), "idx": get_idx_path(prefix), "meta": meta_path(prefix)}


def _commit(tmp: dict[str, str], final: dict[str, str]) -> None:
    """Move the finished temporary files into place so that no crash leaves a loadable mix.

    A reader finds a dataset through its .idx, and the up-to-date check
    through .meta.json, so both old ones go first: until the new .idx lands
    the prefix does not load at all, and a new .bin/.idx without a .meta.json
    is rebuilt by the next run.
    """
    for key in ("bin", "idx", "meta"):
        with open(tmp[key], "rb") as fh:
            os.fsync(fh.fileno())
    for key in ("meta", "idx"):
        if os.path.exists(final[key]):
            os.remove(final[key])
    for key in ("bin", "idx", "meta"):
        os.replace(tmp[key], final[key])


def load_meta(prefix: str) -> dict | None:
    """PREFIX.meta.json as a dict, or None when missing or unreadable."""
    try:
        with open(meta_path(prefix)) as fh:
            meta = json.load(fh)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == META_FORMAT else None


def _same_tokenizer(a: dict, b: dict) -> bool:
    # The model's path may move; its bytes (sha256) are what decide the ids.
    keys = ("type", "model_sha256", "vocab_size", "eod", "pad", "trained_vocab")
    return all(a.get(k) == b.get(k) for k in keys)


def _is_up_to_date(meta: dict | None, prefix: str, source: dict, tokenizer: dict) -> bool:
    if meta is None:
        return False
    paths = _final_paths(prefix)
    return (
        os.path.isfile(paths["idx"])
        and os.path.isfile(paths["bin"])
        and os.path.getsize(paths["bin"]) == meta.get("bin_bytes")
        and meta.get("source", {}).get("file_list_sha256") == source["file_list_sha256"]
        and meta.get("source", {}).get("content_sha256") == source["content_sha256"]
        and _same_tokenizer(meta.get("tokenizer", {}), tokenizer)
    )


# ------------------------------------------------------------------ the build


def _equivalent_command(
    inputs: Sequence[str] | None,
    output_prefix: str,
    tokenizer_type: str,
    tokenizer_model: str | None,
    train_sentencepiece_vocab: int | None,
    extensions: Sequence[str] | None,
) -> str:
    """The CLI line that reproduces a prepare_dataset() call (for meta.json)."""
    argv = ["python", "-m", "megatron_lrmoe.data.prepare"]
    if inputs:
        argv += ["--input", *inputs]
    argv += ["--output-prefix", output_prefix, "--tokenizer-type", tokenizer_type]
    if tokenizer_model:
        argv += ["--tokenizer-model", tokenizer_model]
    if train_sentencepiece_vocab:
        argv += ["--train-sentencepiece-vocab", str(train_sentencepiece_vocab)]
    if extensions and inputs:
        argv += ["--extensions", ",".join(extensions)]
    return shlex.join(argv)


def _resolve_tokenizer_args(
    tokenizer_type: str | None, tokenizer_model: str | None, train_vocab: int | None
) -> str:
    if not train_vocab:
        return tokenizer_type or "ByteLevelTokenizer"
    if tokenizer_type not in (None, "SentencePieceTokenizer"):
        raise DataPrepError(
            f"--train-sentencepiece-vocab trains a SentencePieceTokenizer; "
            f"drop --tokenizer-type {tokenizer_type}"
        )
    if tokenizer_model:
        raise DataPrepError(
            "--train-sentencepiece-vocab writes its model to PREFIX.model; drop --tokenizer-model "
            "(or drop --train-sentencepiece-vocab to use the given model)"
        )
    return "SentencePieceTokenizer"


def _open_pool(workers: int, tokenizer_type: str, tokenizer_model: str | None):
    # fork: workers start in milliseconds instead of re-importing megatron.core
    # (~7 s each); they only run numpy and sentencepiece, never torch.
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
    ctx = multiprocessing.get_context(method)
    return ctx.Pool(workers, _init_worker, (tokenizer_type, tokenizer_model))


def _encode_and_write(
    corpus: Corpus,
    tokenizer_type: str,
    tokenizer_model: str | None,
    tmp: dict[str, str],
    workers: int,
) -> dict:
    """Tokenize every file into tmp bin/idx; returns the token statistics for meta.json."""
    encoder = _DocumentEncoder(tokenizer_type, tokenizer_model)
    histogram = UnigramHistogram(encoder.tokenizer.vocab_size)
    use_pool = workers > 1 and len(corpus.files) > 1
    pool = _open_pool(workers, tokenizer_type, tokenizer_model) if use_pool else None
    builder = IndexedDatasetBuilder(tmp["bin"], dtype=encoder.dtype)
    num_tokens = 0
    try:
        for chunk in _chunks(corpus, CHUNK_BYTES):
            if pool is None:
                docs = [encoder(task) for task in chunk]
            else:
                chunksize = max(1, len(chunk) // (4 * workers))
                docs = pool.map(_encode_in_worker, chunk, chunksize=chunksize)
            for doc in docs:
                builder.add_document(doc, [doc.size])
                histogram.add(doc)
                num_tokens += doc.size
        builder.finalize(tmp["idx"])
    finally:
        builder.data_file.close()  # already closed by finalize on success; needed on failure
        if pool is not None:
            pool.terminate()
            pool.join()

    return {
        "dtype": numpy.dtype(encoder.dtype).name,
        "bin_bytes": os.path.getsize(tmp["bin"]),
        "tokenizer": encoder.tokenizer.describe(),
        "num_tokens": num_tokens,
        "unigram_entropy_nats": histogram.entropy_nats(),
    }


def prepare_dataset(
    inputs: Sequence[str] | None,
    output_prefix: str,
    tokenizer_type: str | None = None,
    tokenizer_model: str | None = None,
    train_sentencepiece_vocab: int | None = None,
    extensions: str | Sequence[str] | None = None,
    workers: int | None = None,
    force: bool = False,
    min_tokens: int = 1,
    command: str | None = None,
    log: Callable[[str], None] | None = print,
) -> dict:
    """Build (or confirm up to date) the indexed dataset at `output_prefix`; returns its metadata.

    Args:
        inputs: text files and folders; None or empty means the stdlib default corpus.
        output_prefix: writes PREFIX.bin, PREFIX.idx, PREFIX.meta.json (and PREFIX.model
            when training a tokenizer).
        tokenizer_type: "ByteLevelTokenizer" (default) or "SentencePieceTokenizer".
        tokenizer_model: the sentencepiece .model file for SentencePieceTokenizer.
        train_sentencepiece_vocab: train a sentencepiece model of this size on the corpus first.
        extensions: file types taken from folders (".py,.txt" or a list); files named
            explicitly are always taken.
        workers: tokenizer processes (default min(4, cpus)).
        force: rebuild even when the existing files are up to date.
        min_tokens: fail when the corpus has fewer text tokens (eod not counted).
        command: the command line recorded in meta.json (default: an equivalent CLI line).
        log: progress printer; None for silence.

    Raises:
        DataPrepError: bad input or output path, binary input, too little text.
    """
    started = time.time()
    log = log or (lambda _msg: None)
    workers = default_workers() if workers is None else workers
    if workers < 1:
        raise DataPrepError(f"--workers {workers}: need at least 1")
    if output_prefix.endswith(("/", os.sep)):
        raise DataPrepError(
            f"--output-prefix {output_prefix!r} ends in a separator; add a file name stem, "
            f"e.g. {output_prefix}corpus"
        )
    prefix = os.path.abspath(output_prefix)
    tokenizer_type = _resolve_tokenizer_args(
        tokenizer_type, tokenizer_model, train_sentencepiece_vocab
    )
    if command is None:
        command = _equivalent_command(
            inputs,
            output_prefix,
            tokenizer_type,
            tokenizer_model,
            train_sentencepiece_vocab,
            parse_extensions(extensions) if extensions else None,
        )
    if train_sentencepiece_vocab:
        tokenizer_model = prefix + ".model"
        tokenizer = None  # known once trained (or found up to date)
    else:
        tokenizer = build_tokenizer(tokenizer_type, tokenizer_model)  # bad flags fail here

    # -- harvest and scan: every input problem surfaces here, before any writing
    corpus, source = _harvest_and_scan(inputs, extensions)
    if corpus.skipped:
        first = ", ".join(corpus.skipped[:5])
        log(f"skipped {len(corpus.skipped)} file(s) found under {corpus.root} that are not "
            f"UTF-8 text: {first}{', ...' if len(corpus.skipped) > 5 else ''} (listed in "
            f"meta.json; name one in --input to see why)")
    _check_output_dir(prefix)

    # -- up to date?
    if not force:
        meta = load_meta(prefix)
        current = tokenizer
        if current is None and meta is not None and os.path.isfile(tokenizer_model):
            current = build_tokenizer(tokenizer_type, tokenizer_model)
        if current is not None and _is_up_to_date(
            meta, prefix, source, current.describe() | {"trained_vocab": train_sentencepiece_vocab}
        ):
            log(
                f"{prefix}.{{bin,idx,meta.json}} is up to date ({meta.get('num_documents')} "
                f"documents, {meta.get('num_tokens')} tokens); pass --force to rebuild"
            )
            return meta

    if train_sentencepiece_vocab:
        log(
            f"training a {train_sentencepiece_vocab}-piece sentencepiece model -> {tokenizer_model}"
        )
        train_sentencepiece([f.path for f in corpus.files], prefix, train_sentencepiece_vocab)

    # -- encode and write under temporary names, then commit
    if tokenizer_type in _MEMORY_SPEED_TOKENIZERS:
        workers = 1
    log(
        f"tokenizing {len(corpus.files)} files ({corpus.total_bytes / 1e6:.1f} MB) "
        f"from {corpus.root} with {tokenizer_type}, {workers} process(es)"
    )
    final = _final_paths(prefix)
    tmp = {key: f"{path}.partial-{os.getpid()}" for key, path in final.items()}
    try:
        stats = _encode_and_write(corpus, tokenizer_type, tokenizer_model, tmp, workers)
        text_tokens = stats["num_tokens"] - len(corpus.files)
        if text_tokens < min_tokens:
            raise DataPrepError(
                f"the corpus under {corpus.root} yields {text_tokens} text tokens, under the "
                f"minimum of {min_tokens}; add more --input text"
            )
        meta = {
            "format": META_FORMAT,
            "prefix": prefix,
            "dtype": stats["dtype"],
            "bin_bytes": stats["bin_bytes"],
            "num_documents": len(corpus.files),
            "num_tokens": stats["num_tokens"],
            "total_bytes": corpus.total_bytes,
            "unigram_entropy_nats": stats["unigram_entropy_nats"],
            "tokenizer": stats["tokenizer"] | {"trained_vocab": train_sentencepiece_vocab},
            "source": source,
            "license": corpus.license,
            "command": command,
            "megatron_core": megatron.core.package_info.__shortversion__,
            "created_unix": round(started),
            "elapsed_s": round(time.time() - started, 3),
        }
        with open(tmp["meta"], "w") as fh:
            json.dump(meta, fh, indent=2)
            fh.write("\n")
        _commit(tmp, final)
    except OSError as e:
        raise DataPrepError(f"writing {prefix}.{{bin,idx,meta.json}} failed: {e}") from e
    finally:
        for path in tmp.values():
            if os.path.exists(path):
                os.remove(path)

    log(
        f"wrote {final['bin']} ({meta['num_documents']} documents, {meta['num_tokens']} tokens, "
        f"unigram entropy {meta['unigram_entropy_nats']:.4f} nats) in {meta['elapsed_s']:.1f}s"
    )
    return meta


def _harvest_and_scan(
    inputs: Sequence[str] | None, extensions: str | Sequence[str] | None
) -> tuple[Corpus, dict]:
    """The corpus and its meta.json "source" record; raises on any unusable input."""
    default_corpus = not inputs
    corpus = stdlib_corpus() if default_corpus else without_undecodable(
        harvest(inputs, extensions))
    if not corpus.files and corpus.skipped:
        raise DataPrepError(
            f"none of the {len(corpus.skipped)} files found under {corpus.root} is UTF-8 "
            f"text (first: {corpus.skipped[0]}); pass --extensions to choose text file types")
    if corpus.total_bytes == 0:
        raise DataPrepError(
            f"the {len(corpus.files)} input files under {corpus.root} are all empty; "
            f"give --input files with text"
        )
    source = {
        "root": corpus.root,
        "default_corpus": default_corpus,
        "num_files": len(corpus.files),
        "file_list_sha256": corpus.file_list_sha256,
        "content_sha256": content_sha256(corpus),
        "extensions": list(parse_extensions(".py" if default_corpus else extensions)),
        "skipped": list(corpus.skipped),
    }
    return corpus, source


# ------------------------------------------------------------------ CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m megatron_lrmoe.data.prepare",
        description="Tokenize text files into a Megatron indexed dataset (PREFIX.bin/.idx).",
    )
    p.add_argument(
        "--input",
        nargs="+",
        action="extend",
        default=[],
        metavar="PATH",
        help="text files or folders (recursive); default: the Python stdlib sources",
    )
    p.add_argument("--output-prefix", required=True, metavar="PREFIX")
    p.add_argument(
        "--tokenizer-type",
        default=None,
        help="ByteLevelTokenizer (default) or SentencePieceTokenizer",
    )
    p.add_argument(
        "--tokenizer-model",
        default=None,
        metavar="PATH",
        help="sentencepiece .model file for SentencePieceTokenizer",
    )
    p.add_argument(
        "--train-sentencepiece-vocab",
        type=int,
        default=None,
        metavar="N",
        help="train an N-piece sentencepiece model on the corpus (PREFIX.model)",
    )
    p.add_argument(
        "--extensions",
        default=None,
        help="file types taken from folders, e.g. .py,.txt (default .py,.txt,.md,.rst)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help=f"tokenizer processes (default {default_workers()})",
    )
    p.add_argument("--force", action="store_true", help="rebuild even if up to date")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    command = shlex.join([sys.executable, "-m", "megatron_lrmoe.data.prepare", *argv])
    try:
        prepare_dataset(
            args.input or None,
            args.output_prefix,
            tokenizer_type=args.tokenizer_type,
            tokenizer_model=args.tokenizer_model,
            train_sentencepiece_vocab=args.train_sentencepiece_vocab,
            extensions=args.extensions,
            workers=args.workers,
            force=args.force,
            command=command,
        )
    except DataPrepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
