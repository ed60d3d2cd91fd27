"""Harvest and validate the text files that become a training corpus.

A corpus is a sorted list of UTF-8 text files under one root, one document per
file. Sorting by path relative to the root makes the document order, and so
the dataset bytes, independent of the order the inputs were given in and of
the filesystem's directory order.

Nothing here tokenizes: this tier only decides *which* bytes go in, and fails
early, naming the offending path and the fix, when an input cannot be used.
"""

import gzip
import hashlib
import os
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

DEFAULT_EXTENSIONS: tuple[str, ...] = (".py", ".txt", ".md", ".rst")

# Folders that never hold corpus text: bytecode caches and VCS metadata.
ALWAYS_EXCLUDED_DIRS: frozenset[str] = frozenset({"__pycache__", ".git", ".hg", ".svn"})

# The default corpus is CPython's own library, not whatever happens to be
# pip-installed next to it (third-party code under other licenses).
STDLIB_EXCLUDED_DIRS: frozenset[str] = ALWAYS_EXCLUDED_DIRS | {"site-packages", "dist-packages"}

STDLIB_LICENSE = (
    "Python Software Foundation License Version 2 "
    "(CPython standard library sources, https://docs.python.org/3/license.html)"
)
UNKNOWN_LICENSE = "unspecified (user-supplied inputs: check the license of each source)"


class DataPrepError(ValueError):
    """An input or output problem the user can fix; the message names the path and the fix."""


@dataclass(frozen=True)
class CorpusFile:
    """One document: its absolute path, its path relative to the corpus root, its size."""

    path: str
    relpath: str
    size: int


@dataclass(frozen=True)
class Corpus:
    """A sorted, deduplicated list of text files under one root.

    `skipped` lists relative paths that a folder walk matched but that are not
    UTF-8 text (`without_undecodable`: a few stdlib test files are deliberately
    not UTF-8; a user's folder may hold a Latin-1 header or a binary).
    """

    root: str
    files: tuple[CorpusFile, ...]
    license: str = UNKNOWN_LICENSE
    skipped: tuple[str, ...] = ()
    # Files found by walking a folder (as opposed to named explicitly): the
    # error for a binary one suggests --extensions instead of --input.
    walked: frozenset[str] = frozenset()

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def file_list_sha256(self) -> str:
        """sha256 over the sorted `relpath<TAB>size` lines: cheap (stat only), and it changes
        whenever a file is added, removed, renamed or resized."""
        h = hashlib.sha256()
        for f in self.files:
            h.update(f"{f.relpath}\t{f.size}\n".encode("utf-8", "surrogateescape"))
        return h.hexdigest()


def parse_extensions(spec: str | Sequence[str] | None) -> tuple[str, ...]:
    """'.py,txt' or ['.py', 'txt'] -> ('.py', '.txt'); lower-cased, dot-prefixed, deduplicated."""
    if spec is None:
        return DEFAULT_EXTENSIONS
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    exts = []
    for item in items:
        item = item.strip().lower()
        if not item:
            continue
        ext = item if item.startswith(".") else "." + item
        if ext not in exts:
            exts.append(ext)
    if not exts:
        raise DataPrepError(
            f"--extensions {spec!r} names no extension; use e.g. --extensions .py,.txt"
        )
    return tuple(exts)


def _walk_folder(folder: str, extensions: tuple[str, ...], exclude_dirs: frozenset[str]):
    """Yield the matching files under `folder`, never descending into excluded folder names."""
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if d not in exclude_dirs]
        for name in filenames:
            if name.lower().endswith(extensions):
                path = os.path.join(dirpath, name)
                if os.path.isfile(path):  # skips dangling symlinks and sockets
                    yield path


def harvest(
    inputs: Iterable[str],
    extensions: str | Sequence[str] | None = None,
    exclude_dirs: frozenset[str] = ALWAYS_EXCLUDED_DIRS,
    license: str = UNKNOWN_LICENSE,
) -> Corpus:
    """Collect the files named by `inputs` (files or folders, folders searched recursively).

    Files named explicitly are taken whatever their extension; files inside
    folders must end in one of `extensions`. The root is the deepest folder
    containing every input, and documents are ordered by their path under it.

    Raises DataPrepError for a missing path, or a folder with no matching file.
    """
    exts = parse_extensions(extensions)
    inputs = [os.path.abspath(p) for p in inputs]
    if not inputs:
        raise DataPrepError("no input given; pass --input PATH (a text file or a folder)")

    found: dict[str, bool] = {}  # path -> found by walking a folder
    for path in inputs:
        if os.path.isdir(path):
            matches = list(_walk_folder(path, exts, exclude_dirs))
            if not matches:
                raise DataPrepError(
                    f"no file ending in {','.join(exts)} under folder {path}; "
                    f"pass --extensions to choose other file types"
                )
            for m in matches:
                found.setdefault(m, True)
        elif os.path.isfile(path):
            found[path] = False
        elif os.path.lexists(path):
            raise DataPrepError(f"input {path} is neither a regular file nor a folder")
        else:
            raise DataPrepError(f"input path does not exist: {path}; check --input")

    anchors = [p if os.path.isdir(p) else os.path.dirname(p) for p in inputs]
    root = os.path.commonpath(anchors)
    files = sorted(
        (CorpusFile(p, os.path.relpath(p, root), os.path.getsize(p)) for p in found),
        key=lambda f: f.relpath,
    )
    walked = frozenset(p for p, by_walk in found.items() if by_walk)
    return Corpus(root=root, files=tuple(files), license=license, walked=walked)


def stdlib_corpus(extensions: str | Sequence[str] | None = (".py",)) -> Corpus:
    """The default corpus: the running interpreter's standard library sources.

    Real, varied text that nobody on this project wrote, present on every
    machine that runs the project, under a permissive license. The handful of
    stdlib test files that are deliberately not UTF-8 (encoding tests) are
    skipped and listed, instead of failing the run as a user's binary would.
    """
    root = sysconfig.get_paths()["stdlib"]
    return without_undecodable(harvest([root], extensions, STDLIB_EXCLUDED_DIRS, STDLIB_LICENSE))


def without_undecodable(corpus: Corpus) -> Corpus:
    """`corpus` less the files a folder walk found that are not UTF-8 text (NUL bytes or
    invalid UTF-8, after gzip decompression), listed in `skipped`. A file named
    explicitly stays: `content_sha256` stops on it with the error naming it."""
    keep, skipped = [], []
    for f in corpus.files:
        ok = f.path not in corpus.walked or text_problem(read_document(f.path)) is None
        (keep if ok else skipped).append(f)
    return Corpus(
        root=corpus.root,
        files=tuple(keep),
        license=corpus.license,
        skipped=corpus.skipped + tuple(f.relpath for f in skipped),
        walked=corpus.walked,
    )


def text_problem(data: bytes) -> str | None:
    """Why `data` is not usable UTF-8 text, or None when it is."""
    nul = data.find(b"\0")
    if nul >= 0:
        return f"NUL byte at offset {nul}"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"not valid UTF-8 at offset {e.start}"
    return None


def _binary_error(path: str, problem: str, found_in_folder: bool) -> DataPrepError:
    fix = (
        "narrow --extensions so the folder walk skips it, or delete it"
        if found_in_folder
        else "remove it from --input"
    )
    return DataPrepError(f"{path} looks binary ({problem}); {fix}")


def decode_text(data: bytes, path: str, found_in_folder: bool = False) -> str:
    """`data` (read from `path`) as str; DataPrepError naming the path and the fix if binary."""
    problem = text_problem(data)
    if problem is not None:
        raise _binary_error(path, problem, found_in_folder)
    return data.decode("utf-8")


def read_document(path: str) -> bytes:
    """The bytes of one document. A file ending in .gz is gzip-decompressed (as the manual
    pages under /usr/share/man are stored); DataPrepError if it is not gzip data."""
    with open(path, "rb") as fh:
        data = fh.read()
    if path.lower().endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as e:
            raise DataPrepError(f"{path} ends in .gz but is not gzip data ({e}); "
                                "decompress or remove it") from None
    return data


def read_text(path: str, found_in_folder: bool = False) -> str:
    """Read one document as str (decompressed, see `read_document`), validating it like
    `decode_text`."""
    return decode_text(read_document(path), path, found_in_folder)


def content_sha256(corpus: Corpus) -> str:
    """Read every file once: fail on the first binary one, and hash the contents.

    The result is sha256 over each file's relative path and content digest,
    in corpus order. The file-list hash only sees sizes; this one also
    catches a same-size edit. Reading 30 MB takes a fraction of a second, so
    running it before any tokenizer training or writing makes a bad input
    fail in that time instead of halfway through a build.
    """
    h = hashlib.sha256()
    for f in corpus.files:
        data = read_document(f.path)
        problem = text_problem(data)
        if problem is not None:
            raise _binary_error(f.path, problem, f.path in corpus.walked)
        digest = hashlib.sha256(data).hexdigest()
        h.update(f"{f.relpath}\t{digest}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()
