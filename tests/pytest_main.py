"""Entry point of every Bazel test target: runs pytest on the files given as arguments.

Bazel runs tests from the runfiles root of the workspace, where ``kda`` (with
``kda.backends``) and ``tests`` are importable. The cache provider is off (the sandbox is
read-only). Each test gets a third of the target's Bazel timeout ($TEST_TIMEOUT) as its own
limit (pytest-timeout), so a hung test is reported by name, with its stack, before Bazel
kills the target. A target with ``shard_count`` runs its share of the tests in each shard
(``--kda-shard``, tests/conftest.py), and says so to Bazel ($TEST_SHARD_STATUS_FILE).

Bazel runs as many tests at once as the machine has cores, so each test process computes on
one thread (``OMP_NUM_THREADS=1`` unless set): with torch's default of a thread per core,
two test processes on two cores spent about 40% more CPU time on the same work.
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
    os.environ.setdefault("OMP_NUM_THREADS", "1")      # before anything imports torch
    limit = int(os.environ.get("TEST_TIMEOUT", "0")) // 3
    timeout = [f"--timeout={limit}"] if limit else []
    shards = int(os.environ.get("TEST_TOTAL_SHARDS", "1"))
    shard = [f"--kda-shard={os.environ['TEST_SHARD_INDEX']}/{shards}"] if shards > 1 else []
    if shards > 1 and os.environ.get("TEST_SHARD_STATUS_FILE"):
        open(os.environ["TEST_SHARD_STATUS_FILE"], "w").close()
    sys.exit(pytest.main(["-p", "no:cacheprovider", "--import-mode=importlib", "-ra", *timeout,
                          *shard, *sys.argv[1:]]))
