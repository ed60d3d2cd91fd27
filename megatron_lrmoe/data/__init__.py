"""Data tier: offline tokenizers, corpus harvesting, the indexed-dataset prepare tool, and
the routing-trace format (``routing_traces``: what ``--record-routing`` writes and the tools read).

build_tokenizer("ByteLevelTokenizer")        -> a tokenizer GPTDatasetConfig accepts
prepare_dataset(inputs, "data/stdlib")       -> data/stdlib.{bin,idx,meta.json}
python -m megatron_lrmoe.data.prepare ...    -> the same, from the shell
"""

from megatron_lrmoe.data.corpus import Corpus, CorpusFile, DataPrepError, harvest, stdlib_corpus

__all__ = [
    "TOKENIZER_TYPES",
    "ByteLevelTokenizer",
    "Corpus",
    "CorpusFile",
    "DataPrepError",
    "SentencePieceTokenizer",
    "build_tokenizer",
    "harvest",
    "load_meta",
    "prepare_dataset",
    "stdlib_corpus",
    "train_sentencepiece",
    "unigram_entropy_nats",
]


# The prepare tool is imported lazily: ``python -m megatron_lrmoe.data.prepare`` would
# otherwise find its own module already imported by this package (a runpy warning). So
# are the tokenizers, which import megatron.core: the prepare command hides megatron-core's
# known import-time notices before its first import of Megatron.
_PREPARE_NAMES = ("load_meta", "prepare_dataset", "unigram_entropy_nats")
_TOKENIZER_NAMES = ("TOKENIZER_TYPES", "ByteLevelTokenizer", "SentencePieceTokenizer",
                    "build_tokenizer", "train_sentencepiece")


def __getattr__(name: str):
    if name in _PREPARE_NAMES:
        from megatron_lrmoe.data import prepare

        return getattr(prepare, name)
    if name in _TOKENIZER_NAMES:
        from megatron_lrmoe.data import tokenizers

        return getattr(tokenizers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
