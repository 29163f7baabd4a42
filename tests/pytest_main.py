"""Entry point of every Bazel test target: runs pytest on the files given as arguments.

Bazel runs tests from the runfiles root of the workspace, where ``kda``, ``backends`` and
``tests`` are importable. The cache provider is off (the sandbox is read-only).
"""

import os
import sys

import pytest

if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    sys.exit(pytest.main(["-p", "no:cacheprovider", "-ra", *sys.argv[1:]]))
