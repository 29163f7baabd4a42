"""Entry point of every Bazel test target: runs pytest on the files given as arguments.

Bazel runs tests from the runfiles root of the workspace, where ``kda`` (with
``kda.backends``) and ``tests`` are importable. The cache provider is off (the sandbox is
read-only). Each test gets a third of the target's Bazel timeout ($TEST_TIMEOUT) as its own
limit (pytest-timeout), so a hung test is reported by name, with its stack, before Bazel
kills the target.
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
    limit = int(os.environ.get("TEST_TIMEOUT", "0")) // 3
    timeout = [f"--timeout={limit}"] if limit else []
    sys.exit(pytest.main(["-p", "no:cacheprovider", "--import-mode=importlib", "-ra", *timeout,
                          *sys.argv[1:]]))
