"""tools/gpu/tree_digest.sh: the digest session.sh writes into a run's summary.txt, so that a
results folder's hand-typed commit label can be checked against the files that ran."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SCRIPT = os.path.join(ROOT, "tools", "gpu", "tree_digest.sh")


def _digest(d):
    out = subprocess.run(["bash", SCRIPT, "--dir", str(d)], check=True, capture_output=True,
                         text=True).stdout.strip()
    assert len(out) == 16 and all(c in "0123456789abcdef" for c in out), out
    return out


def _tree(d):
    files = {"kda/a.py": "x = 1\n", "backends/cuda/k.cu": "// k\n", "backends/cuda/k.h": "",
             "tools/gpu/s.sh": "echo\n", "tools/kda": "#!/bin/sh\n", "tests/BUILD": "# b\n",
             "tests/defs.bzl": "", "third_party/x/BUILD": "", "WORKSPACE": "", "BUILD": "",
             ".bazelrc": "", ".bazelversion": "4\n", "pyproject.toml": "[project]\n"}
    for p, text in files.items():
        os.makedirs(os.path.join(d, os.path.dirname(p)), exist_ok=True)
        with open(os.path.join(d, p), "w") as f:
            f.write(text)


def test_digest_follows_source_contents_and_paths_only(tmp_path):
    _tree(tmp_path)
    base = _digest(tmp_path)
    assert _digest(tmp_path) == base                      # deterministic
    copy = tmp_path / "copy"
    copy.mkdir()
    _tree(copy)
    assert _digest(copy) == base                          # independent of where the tree is
    # caches and folders outside the digested paths do not count
    os.makedirs(tmp_path / "kda" / "__pycache__")
    (tmp_path / "kda" / "__pycache__" / "a.py").write_text("cached")
    (tmp_path / "kda" / "a.pyc").write_text("cached")
    os.makedirs(tmp_path / "docs")
    (tmp_path / "docs" / "x.py").write_text("y = 2\n")
    assert _digest(tmp_path) == base
    # a changed byte (a script without extension, a Bazel file, a top-level file), a new file
    # of any kind, a moved file: a different digest
    for p in ("kda/a.py", "tools/kda", "tests/defs.bzl", "WORKSPACE"):
        old = (tmp_path / p).read_text()
        (tmp_path / p).write_text(old + " ")
        assert _digest(tmp_path) != base, p
        (tmp_path / p).write_text(old)
        assert _digest(tmp_path) == base, p
    (tmp_path / "tests" / "a name with spaces.json").write_text("{}")
    assert _digest(tmp_path) != base
    os.remove(tmp_path / "tests" / "a name with spaces.json")
    shutil.move(str(tmp_path / "kda" / "a.py"), str(tmp_path / "kda" / "b.py"))
    assert _digest(tmp_path) != base


def test_a_tree_missing_a_digested_path_fails(tmp_path):
    _tree(tmp_path)
    os.remove(tmp_path / "WORKSPACE")
    r = subprocess.run(["bash", SCRIPT, "--dir", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode != 0 and r.stdout == "" and "WORKSPACE" in r.stderr


@pytest.mark.skipif(shutil.which("git") is None or not os.path.isdir(os.path.join(ROOT, ".git")),
                    reason="needs a git checkout (Bazel's sandbox has none; runs under plain pytest)")
def test_commit_form_matches_a_clean_checkout():
    """``tree_digest.sh HEAD`` digests what ``git archive`` gives; in a checkout whose sources
    match HEAD it equals the working tree's digest."""
    dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--", "WORKSPACE",
                            "BUILD", ".bazelrc", ".bazelversion", "pyproject.toml", "kda",
                            "backends", "tools", "tests", "third_party"],
                           check=True, capture_output=True, text=True).stdout
    if dirty.strip():
        pytest.skip("the sources differ from HEAD (uncommitted changes)")
    head = subprocess.run(["bash", SCRIPT, "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    assert head == _digest(ROOT)
