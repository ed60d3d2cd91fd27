"""Offline tokenizers that Megatron-Core's GPTDataset accepts.

GPTDatasetConfig.tokenizer is read for `vocab_size` (token dtype), `eod`
(document boundaries), `pad` (loss masking; checked against `eos`/`eod` for
collisions) and `unique_identifiers` (written into the dataset cache
key). Both tokenizers here subclass megatron.core's MegatronTokenizerBase, name
themselves in `unique_identifiers` (class and model path, the keys Megatron's own
text tokenizers use), and give eod and pad dedicated ids that no text ever produces.

Id layout:
    ByteLevelTokenizer       0..255 = UTF-8 bytes, 256 = eod, 257 = pad (V = 258)
    SentencePieceTokenizer   0..P-1 = model pieces; eod/pad = the model's eos/pad
                             pieces when it has them, else P, P+1 (V = P + added)

`tokenize` returns list[int] like Megatron's own tokenizers; `tokenize_array`
returns the same ids as a numpy array, the form the prepare tool writes.
"""

import hashlib
import io
import math
import os
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import numpy
import sentencepiece
from megatron.core.tokenizers import MegatronTokenizerBase

from megatron_lrmoe.data.corpus import DataPrepError, read_text

TOKENIZER_TYPES: tuple[str, ...] = ("ByteLevelTokenizer", "SentencePieceTokenizer")


def _sha256_file(path: str) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


class _OfflineTokenizer(MegatronTokenizerBase):
    """What GPTDataset reads of a tokenizer; subclasses set the underscored fields."""

    def __init__(self, path: str | None = None) -> None:
        super().__init__(path, config={})
        # What GPTDataset's cache key records of the tokenizer (its unique_description).
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("tokenizer_path", [path] if path else [])])

    def apply_chat_template(self, *args, **kwargs):
        raise ValueError(f"{type(self).__name__} tokenizes plain text for pretraining; it "
                         f"has no chat template")

    _vocab: dict[str, int]
    _inv_vocab: dict[int, str]
    _vocab_size: int
    _eod: int
    _pad: int

    @property
    def vocab(self) -> dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> dict[int, str]:
        return self._inv_vocab

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        # A GPT corpus has one end marker; Megatron checks pad against both names.
        return self._eod

    @property
    def pad(self) -> int:
        return self._pad


class ByteLevelTokenizer(_OfflineTokenizer):
    """UTF-8 bytes as tokens: no training, no files, exact round trip for any str."""

    NUM_BYTES = 256

    def __init__(self) -> None:
        super().__init__()
        self._eod = self.NUM_BYTES
        self._pad = self.NUM_BYTES + 1
        self._vocab_size = self.NUM_BYTES + 2
        self._vocab = {f"<0x{b:02X}>": b for b in range(self.NUM_BYTES)}
        self._vocab.update({"<eod>": self._eod, "<pad>": self._pad})
        self._inv_vocab = {i: piece for piece, i in self._vocab.items()}

    def tokenize(self, text: str) -> list[int]:
        return list(self._encode(text))

    def tokenize_array(self, text: str) -> numpy.ndarray:
        """[len(utf8)] uint8 ids, without a copy per byte."""
        return numpy.frombuffer(self._encode(text), dtype=numpy.uint8)

    @staticmethod
    def _encode(text: str) -> bytes:
        # surrogatepass: a str holding lone surrogates still encodes, and
        # detokenize decodes it back the same way.
        return text.encode("utf-8", "surrogatepass")

    def detokenize(self, ids: Sequence[int] | numpy.ndarray) -> str:
        """Drop eod/pad, decode the bytes; byte runs that are not UTF-8 become U+FFFD."""
        ids = numpy.asarray(ids, dtype=numpy.int64).ravel()
        data = ids[(ids >= 0) & (ids < self.NUM_BYTES)].astype(numpy.uint8).tobytes()
        try:
            return data.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            return data.decode("utf-8", "replace")

    def describe(self) -> dict:
        """What must match for two datasets to hold the same ids (written to meta.json)."""
        return {
            "type": "ByteLevelTokenizer",
            "model": None,
            "model_sha256": None,
            "vocab_size": self.vocab_size,
            "eod": self.eod,
            "pad": self.pad,
        }



# SentencePiece writes spaces as this meta symbol and turns it back into a
# space when decoding, so a literal U+2581 in the text needs special care.
_SP_SPACE = "\u2581"


class SentencePieceTokenizer(_OfflineTokenizer):
    """A local sentencepiece model (`--tokenizer-model`), with dedicated eod and pad ids."""

    def __init__(self, model_path: str) -> None:
        if not os.path.isfile(model_path):
            raise DataPrepError(
                f"sentencepiece model not found: {model_path}; fix --tokenizer-model, or train "
                f"one with --train-sentencepiece-vocab N"
            )
        super().__init__(model_path)
        self.model_path = model_path
        self._sp = sentencepiece.SentencePieceProcessor(model_file=model_path)
        self._num_pieces = self._sp.get_piece_size()
        # Models trained elsewhere may lack eos or pad; append ids past the pieces.
        next_id = self._num_pieces
        self._eod = self._sp.eos_id()
        if self._eod < 0:
            self._eod, next_id = next_id, next_id + 1
        self._pad = self._sp.pad_id()
        if self._pad < 0:
            self._pad, next_id = next_id, next_id + 1
        self._vocab_size = next_id

        self._vocab = {self._sp.id_to_piece(i): i for i in range(self._num_pieces)}
        self._vocab.setdefault("<eod>", self._eod)
        self._vocab.setdefault("<pad>", self._pad)
        self._inv_vocab = {i: piece for piece, i in self._vocab.items()}

        # A literal U+2581 is written as its UTF-8 byte pieces, which decode to
        # the character itself; only possible when the model has byte pieces.
        space_bytes = [self._sp.piece_to_id(f"<0x{b:02X}>") for b in _SP_SPACE.encode()]
        has_bytes = all(self._sp.is_byte(i) for i in space_bytes)
        self._literal_space_ids = space_bytes if has_bytes else None

    def tokenize(self, text: str) -> list[int]:
        if self._literal_space_ids is None or _SP_SPACE not in text:
            return self._sp.encode(text)
        ids: list[int] = []
        for k, part in enumerate(text.split(_SP_SPACE)):
            if k:
                ids.extend(self._literal_space_ids)
            ids.extend(self._sp.encode(part))
        return ids

    def tokenize_array(self, text: str) -> numpy.ndarray:
        return numpy.asarray(self.tokenize(text), dtype=numpy.int32)

    def detokenize(self, ids: Sequence[int] | numpy.ndarray) -> str:
        """Drop eod/pad (and any id past the model's pieces), decode the rest."""
        specials = (self._eod, self._pad)
        keep = [int(i) for i in ids if 0 <= i < self._num_pieces and i not in specials]
        return self._sp.decode(keep)

    def describe(self) -> dict:
        return {
            "type": "SentencePieceTokenizer",
            "model": os.path.abspath(self.model_path),
            "model_sha256": _sha256_file(self.model_path),
            "vocab_size": self.vocab_size,
            "eod": self.eod,
            "pad": self.pad,
        }



def _nonblank_lines(path: str) -> list[str]:
    return [line for line in read_text(path).split("\n") if line.strip()]


def _sampled_lines(files: Sequence[str], max_lines: int) -> Iterator[str]:
    """Every k-th non-blank line of `files`, k chosen so at most `max_lines` come out.

    Sampling here instead of in sentencepiece (input_sentence_size) because
    its reservoir sampler is seeded per process: the same corpus gave a
    different model on every run. A fixed stride is deterministic and spreads
    the sample over the whole corpus. Two passes keep memory at one file.
    """
    total = sum(len(_nonblank_lines(path)) for path in files)
    stride = max(1, math.ceil(total / max_lines))
    k = 0
    for path in files:
        for line in _nonblank_lines(path):
            if k % stride == 0:
                yield line
            k += 1


def train_sentencepiece(
    files: Sequence[str],
    model_prefix: str,
    vocab_size: int,
    *,
    model_type: str = "bpe",
    max_sentences: int = 200_000,
    max_sentence_length: int = 8192,
    num_threads: int = 1,
) -> str:
    """Train a sentencepiece model on the lines of `files`; returns `{model_prefix}.model`.

    Settings chosen for code-like text, exact round trips and reproducibility:
    - BPE on at most `max_sentences` lines (an even sample): seconds for the
      30 MB stdlib; unigram EM takes ~10x longer.
    - identity normalization, no dummy prefix, no whitespace folding, and byte
      fallback: decode(encode(text)) == text for any text, indentation included.
    - eos piece `<eod>` at id 1 and pad `<pad>` at id 2 give the dedicated
      specials; no bos (GPT data has only document ends).
    - Deterministic: same files, same model bytes. The model does depend on
      `num_threads` (1 and 2 give different merges), hence the fixed default.

    The model is written under a temporary name and renamed, so a crash never
    leaves a truncated model behind.
    """
    if vocab_size < 300:
        raise DataPrepError(
            f"--train-sentencepiece-vocab {vocab_size} is too small: byte fallback alone needs "
            f"259 ids; use at least 300 (a few thousand suits a 10 MB corpus)"
        )
    model = io.BytesIO()
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=_sampled_lines(files, max_sentences),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            input_sentence_size=0,  # sampled above
            shuffle_input_sentence=False,
            max_sentence_length=max_sentence_length,
            byte_fallback=True,
            normalization_rule_name="identity",
            add_dummy_prefix=False,
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            character_coverage=0.9995,
            unk_id=0,
            eos_id=1,
            pad_id=2,
            bos_id=-1,
            eos_piece="<eod>",
            pad_piece="<pad>",
            hard_vocab_limit=False,  # a small corpus yields fewer pieces instead of failing
            num_threads=num_threads,
            minloglevel=2,
        )
    except RuntimeError as e:
        raise DataPrepError(f"sentencepiece training on {len(files)} files failed: {e}") from e

    path = f"{model_prefix}.model"
    tmp = f"{path}.partial-{os.getpid()}"
    with open(tmp, "wb") as fh:
        fh.write(model.getvalue())
    os.replace(tmp, path)
    return path


def build_tokenizer(
    tokenizer_type: str = "ByteLevelTokenizer", tokenizer_model: str | None = None
) -> ByteLevelTokenizer | SentencePieceTokenizer:
    """The tokenizer for Megatron-LM's `--tokenizer-type` / `--tokenizer-model` flag values."""
    if tokenizer_type == "ByteLevelTokenizer":
        if tokenizer_model is not None:
            raise DataPrepError(
                "--tokenizer-model is only used with --tokenizer-type SentencePieceTokenizer"
            )
        return ByteLevelTokenizer()
    if tokenizer_type == "SentencePieceTokenizer":
        if not tokenizer_model:
            raise DataPrepError(
                "--tokenizer-type SentencePieceTokenizer needs --tokenizer-model PATH "
                "(a sentencepiece .model file)"
            )
        return SentencePieceTokenizer(tokenizer_model)
    raise DataPrepError(
        f"unsupported --tokenizer-type {tokenizer_type!r}; supported: {', '.join(TOKENIZER_TYPES)}"
    )
