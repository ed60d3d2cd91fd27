"""A pre-filled Hugging Face cache, so that Bridge's recipes build without the Hub.

Megatron-Bridge's recipes read each model's ``config.json`` from the Hub
(``AutoBridge.from_hf_pretrained("Qwen/Qwen3-30B-A3B", revision=...)``). Without a
network, ``prefilled_hf_cache`` lays out the shipped configs (tests/fixtures/hf_configs,
written from the published architectures) in huggingface_hub's cache layout, and
``offline_hf_environment`` names it with ``HF_HUB_OFFLINE=1``; the recipes are not
changed. huggingface_hub reads these variables when it is imported: set them before
(tests/conftest.py does, before the gloo pools start, which inherit them).

Cache layout (huggingface_hub's): ``models--<org>--<name>/snapshots/<commit>/config.json``
and ``refs/main`` holding the commit. A recipe that pins a revision (Qwen3-30B-A3B's and
Moonlight-16B-A3B's: ``PINNED_REVISIONS``) finds its snapshot under that commit; for the
others, ``main`` points at a local commit id made from the file's own hash.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

#: The shipped configs: one folder per Hub repository, named ``<org>--<name>``.
HF_CONFIGS = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "hf_configs"

#: Revisions the recipes of Megatron-Bridge 0.6.2 pin, by repository: the snapshot must
#: carry this commit id (megatron/bridge/recipes/qwen/h100/qwen3_moe.py:
#: _QWEN3_30B_A3B_MODEL_REVISION, megatron/bridge/recipes/moonlight/h100/moonlight_16b.py:
#: _MOONLIGHT_16B_MODEL_REVISION).
PINNED_REVISIONS: dict[str, str] = {
    "Qwen/Qwen3-30B-A3B": "ad44e777bcd18fa416d9da3bd8f70d33ebb85d39",
    "moonshotai/Moonlight-16B-A3B": "476b36a473d4467f94469414bef6cee75c9c8172",
}


def prefilled_hf_cache(cache_dir: str | os.PathLike[str],
                       configs: str | os.PathLike[str] = HF_CONFIGS) -> Path:
    """Write every ``configs/<org>--<name>/config.json`` into the Hub cache layout under
    ``cache_dir`` and return it. Idempotent."""
    cache = Path(cache_dir)
    sources = sorted(Path(configs).glob("*/config.json"))
    if not sources:
        raise FileNotFoundError(f"no <org>--<name>/config.json under {configs}")
    for source in sources:
        repo_id = source.parent.name.replace("--", "/", 1)
        commit = PINNED_REVISIONS.get(repo_id) or hashlib.sha1(source.read_bytes()).hexdigest()
        repo = cache / f"models--{source.parent.name}"
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, snapshot / "config.json")
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(commit)
    return cache


def offline_hf_environment(cache_dir: str | os.PathLike[str]) -> dict[str, str]:
    """The variables that make huggingface_hub and transformers read ``cache_dir`` only."""
    return {"HF_HUB_CACHE": str(cache_dir), "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
