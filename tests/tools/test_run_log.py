"""Run files stored compressed (megatron_lrmoe.tools.run_log): a compressed log reads as
the plain one did (checked with the standard library's lzma and json), whichever name
the reader gives, and its bytes depend on its text only."""

from __future__ import annotations

import json
import lzma
import os

from megatron_lrmoe.tools import run_log

TEXT = '{"iteration": 1, "lm-loss": 9.5}\n\n{"iteration": 2, "lm-loss": 8.25}\n'


def test_compress_keeps_the_text_and_removes_the_plain_log(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text(TEXT)
    assert run_log.stored(log) == log
    packed = run_log.compress(log)
    assert packed == tmp_path / "log.jsonl.xz" and not log.exists()
    assert lzma.decompress(packed.read_bytes()).decode() == TEXT
    assert run_log.stored(log) == packed
    assert run_log.read_text(log) == run_log.read_text(packed) == TEXT
    assert run_log.read_records(log) == [json.loads(line) for line in TEXT.split("\n") if line]
    assert run_log.compress(log) == packed            # nothing plain left: a no-op
    assert run_log.compress(packed) == packed


def test_compressed_bytes_depend_on_the_text_only(tmp_path):
    first, second = tmp_path / "a" / "log.jsonl", tmp_path / "b" / "other.jsonl"
    for path in (first, second):
        path.parent.mkdir()
        path.write_text(TEXT)
    os.utime(second, (0, 0))
    assert run_log.compress(first).read_bytes() == run_log.compress(second).read_bytes()


def test_the_content_decides_how_a_log_is_read(tmp_path):
    # A plain log under the compressed name (a rename committed before the compression)
    # and a missing log (the reader's error names the path asked for).
    renamed = tmp_path / "log.jsonl.xz"
    renamed.write_text(TEXT)
    assert run_log.read_text(tmp_path / "log.jsonl") == TEXT
    missing = tmp_path / "none" / "log.jsonl"
    assert run_log.stored(missing) == missing


def test_a_runs_stdout_is_stored_alike(tmp_path):
    out = tmp_path / "stdout.txt"
    out.write_text("machine: gemm 1.0 GFLOP/s\n")
    assert run_log.compress(out) == tmp_path / "stdout.txt.xz" and not out.exists()
    assert run_log.read_text(out) == "machine: gemm 1.0 GFLOP/s\n"
