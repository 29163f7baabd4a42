#!/usr/bin/env bash
# The source tree's digest, which tools/gpu/session.sh writes into summary.txt ("tree: ..."),
# so that a results folder's COMMIT can be checked against what actually ran (the commit label
# is typed by hand and the device's .git may be stale):
#
#   tools/gpu/tree_digest.sh               this checkout's files as they are now
#   tools/gpu/tree_digest.sh <commit>      that commit's files (git archive, nothing checked out)
#   tools/gpu/tree_digest.sh --dir <dir>   the files under <dir>
#
# Digest: the first 16 hex digits of sha256 over `sha256sum` of every file of $PATHS (caches
# excluded: __pycache__, *.pyc, *.egg-info), sorted by path. Fails (exit 1, no digest) when one
# of $PATHS is missing. Uncommitted files in the checkout change the digest, as they should.
set -euo pipefail
PATHS=(WORKSPACE BUILD .bazelrc .bazelversion pyproject.toml kda backends tools tests third_party)
root=$(cd "$(dirname "$0")/../.." && pwd)
digest() {
  cd "$1"
  local p
  for p in "${PATHS[@]}"; do
    [ -e "$p" ] || { echo "tree_digest: $1 has no $p" >&2; exit 1; }
  done
  find "${PATHS[@]}" -type f -not -path '*/__pycache__/*' -not -name '*.pyc' \
      -not -path '*.egg-info/*' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum \
    | sha256sum | cut -c1-16
}
case "${1:-}" in
  "") digest "$root" ;;
  --dir) digest "${2:?--dir needs a directory}" ;;
  *) tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
     git -C "$root" archive "$1" "${PATHS[@]}" | tar -x -C "$tmp"
     digest "$tmp" ;;
esac
