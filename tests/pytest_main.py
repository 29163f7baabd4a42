"""Entry point of every Bazel test target: runs pytest on the files given as arguments.

Bazel runs tests from the runfiles root of the workspace, where ``kda``, ``backends`` and
``tests`` are importable. The cache provider is off (the sandbox is read-only).
"""

import os
import sys

import pytest

if __name__ == "__main__":
    # Python put this script's directory (tests/) first on sys.path, where tests/kda would
    # shadow the kda package: drop it, the workspace root (also on sys.path) is what we want.
    here = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != here]
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    sys.exit(pytest.main(["-p", "no:cacheprovider", "--import-mode=importlib", "-ra", *sys.argv[1:]]))
