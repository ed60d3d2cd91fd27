#!/usr/bin/env bash
# Patch Megatron-LM's pretrain_gpt.py (tag core_v0.19.0) to hand over to megatron-lrmoe.
#
#   bash scripts/apply_megatron_patch.sh /path/to/Megatron-LM           # apply (idempotent)
#   bash scripts/apply_megatron_patch.sh --revert /path/to/Megatron-LM  # undo
#
# The patch (patches/megatron_lm_<tag>.patch) imports megatron_lrmoe.integration.megatron_lm and changes
# two lines of pretrain_gpt.py's __main__: parse_and_validate_args gets the LRMoE argument
# provider, and the model config goes through lrmoe_model_config before pretrain() gets it.
# pretrain_gpt.py then needs megatron-lrmoe importable (pip install -e .).
# The tag and the supported megatron-core line (any 0.19.x; the tag reports 0.19.1) are read
# from megatron_lrmoe/options/megatron_support.py, where the package defines them.
# Exit status: 0 applied (or already applied), 1 cannot apply, 2 usage / wrong checkout.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
SUPPORT="$REPO/megatron_lrmoe/options/megatron_support.py"
TAG=$(sed -nE 's/^MEGATRON_LM_TAG *= *"([^"]+)".*/\1/p' "$SUPPORT" 2>/dev/null || true)
LINE=$(sed -nE 's/^SUPPORTED_LINE[^=]*= *\( *([0-9]+) *, *([0-9]+) *\).*/\1.\2/p' "$SUPPORT" \
       2>/dev/null || true)
PATCH="$REPO/patches/megatron_lm_${TAG}.patch"

usage() { echo "usage: $0 [--revert] <megatron-lm-dir>" >&2; exit 2; }
# die MESSAGE [STATUS]: print MESSAGE (only) and exit with STATUS (default 1).
die() { echo "error: $1" >&2; exit "${2:-1}"; }

revert=0
if [ "${1:-}" = "--revert" ]; then revert=1; shift; fi
[ $# -eq 1 ] || usage
dir=$1

[ -n "$TAG" ] && [ -n "$LINE" ] \
  || die "$SUPPORT: no MEGATRON_LM_TAG / SUPPORTED_LINE found; is this a megatron-lrmoe checkout?" 2
[ -f "$PATCH" ] || die "patch not found: $PATCH" 2
[ -d "$dir" ] || die "$dir: no such directory" 2
[ -f "$dir/pretrain_gpt.py" ] || die "$dir: no pretrain_gpt.py; give the root of a Megatron-LM checkout" 2

# Treat $dir as its own tree even when it sits inside another git work tree.
GIT_CEILING_DIRECTORIES=$(dirname "$(cd "$dir" && pwd -P)")
export GIT_CEILING_DIRECTORIES

# The checkout's version: megatron-core's package_info.py, and the git tag when it is a clone.
info="$dir/megatron/core/package_info.py"
[ -f "$info" ] || die "$dir: no megatron/core/package_info.py; is this Megatron-LM?" 2
found=$(sed -nE 's/^(MAJOR|MINOR|PATCH) *= *([0-9]+).*/\2/p' "$info" | paste -sd. -)
# Any release of the supported line (major.minor): core_v0.19.0 itself reports 0.19.1.
if [ "${found%.*}" != "$LINE" ]; then
  die "$dir is megatron-core $found, the patch is for $LINE.x; run: git -C $dir checkout $TAG" 2
fi
if git -C "$dir" rev-parse --git-dir >/dev/null 2>&1; then
  tag=$(git -C "$dir" describe --tags --exact-match 2>/dev/null || true)
  if [ "$tag" != "$TAG" ]; then
    echo "note: $dir is not checked out at $TAG (${tag:-no tag at HEAD}); megatron-core is" \
         "$found, so trying anyway" >&2
  fi
fi

cd "$dir"
if [ "$revert" = 1 ]; then
  if git apply --check "$PATCH" 2>/dev/null; then
    echo "not applied: nothing to revert in $dir"
    exit 0
  fi
  git apply --reverse --check "$PATCH" 2>/dev/null \
    || die "pretrain_gpt.py in $dir was changed after patching; restore it with: git -C $dir checkout $TAG -- pretrain_gpt.py"
  git apply --reverse "$PATCH"
  echo "reverted: $dir/pretrain_gpt.py is Megatron-LM's again"
  exit 0
fi

if git apply --reverse --check "$PATCH" 2>/dev/null; then
  echo "already applied: $dir/pretrain_gpt.py hands over to megatron_lrmoe (nothing to do)"
  exit 0
fi
if ! errors=$(git apply --check "$PATCH" 2>&1); then
  cat >&2 <<EOF
error: the patch does not apply to $dir/pretrain_gpt.py:
$errors
pretrain_gpt.py differs from $TAG (local edits or another version). See what changed with
  git -C $dir diff $TAG -- pretrain_gpt.py
then either restore it (git -C $dir checkout $TAG -- pretrain_gpt.py) and rerun, or make the
three changes of $PATCH by hand, or use the wrapper instead, which needs no patch:
  MEGATRON_LM=$dir python scripts/pretrain_gpt_lrmoe.py <pretrain_gpt.py flags> --moe-lrmoe
EOF
  exit 1
fi
git apply "$PATCH"
echo "applied: $dir/pretrain_gpt.py now accepts --moe-lrmoe* (megatron-lrmoe must be importable)"
