#!/usr/bin/env bash
# The source tree's digest, which tools/gpu/session.sh writes into summary.txt ("tree: ..."),
# so that a results folder's COMMIT can be checked against what actually ran (the commit label
# is typed by hand and the device's .git may be stale):
#
#   tools/gpu/tree_digest.sh               this checkout's files as they are now
#   tools/gpu/tree_digest.sh <commit>      that commit's files (git archive, nothing checked out)
#   tools/gpu/tree_digest.sh --dir <dir>   the files under <dir>
#
# Digest: the first 16 hex digits of sha256 over `sha256sum` of every source file (*.py, *.cu,
# *.h, *.cpp, *.sh, BUILD) under kda/, backends/, tools/ and tests/, sorted by path.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
digest() {
  (cd "$1" && find kda backends tools tests -type f \
      \( -name '*.py' -o -name '*.cu' -o -name '*.h' -o -name '*.cpp' -o -name '*.sh' -o -name BUILD \) \
      -not -path '*/__pycache__/*' | LC_ALL=C sort | xargs -d '\n' sha256sum | sha256sum | cut -c1-16)
}
case "${1:-}" in
  "") digest "$root" ;;
  --dir) digest "${2:?--dir needs a directory}" ;;
  *) tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
     git -C "$root" archive "$1" kda backends tools tests | tar -x -C "$tmp"
     digest "$tmp" ;;
esac
