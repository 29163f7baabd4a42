"""tools/kda, the front door, run with stand-ins for bazel, apt-get and Python on PATH: what
setup says before apt installs, the usage of a bare or wrong ``bench``, an unknown command, a
``KDA_PYTHON`` that does not run, ``test`` with flags only still testing every target, and
``test`` in a log through tools/testlog.py."""

import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
KDA = ROOT / "tools" / "kda"


def _stub(dirpath: pathlib.Path, name: str, body: str) -> None:
    p = dirpath / name
    p.write_text("#!/bin/bash\n" + body + "\n")
    p.chmod(0o755)


@pytest.fixture
def bin_dir(tmp_path):
    """A PATH of the few real tools tools/kda uses, and a stand-in Python that has every
    package (so setup installs none) and says where it is."""
    d = tmp_path / "bin"
    d.mkdir()
    for tool in ("awk", "wc", "id", "sed", "dirname", "cat"):
        os.symlink(shutil.which(tool), d / tool)
    _stub(d, "python3", 'if [ "$1 $2" = "-m tools.testlog" ]; then shift 2; echo testlog; exec "$@"; fi\n'
                        'for a; do case "$a" in *sys.executable*) echo "$0";; esac; done; exit 0')
    _stub(d, "sudo", '"$@"')
    return d


def _run(bin_dir, *args, stderr=subprocess.PIPE):
    env = {"PATH": str(bin_dir), "HOME": str(bin_dir.parent), "LOG": str(bin_dir.parent / "log")}
    return subprocess.run(["/bin/bash", str(KDA), *args], env=env, stdout=subprocess.PIPE,
                          stderr=stderr, text=True, timeout=60)


def test_setup_says_what_apt_installs_before_it_does(bin_dir):
    _stub(bin_dir, "apt-get", 'echo "apt-get $*" >> "$LOG"\n'
                              'case " $* " in *" -s "*) echo "Inst openjdk (1 Debian)";'
                              ' echo "Inst bazel-bootstrap (4.2.3 Debian)";; esac')
    res = _run(bin_dir, "setup")
    assert res.returncode == 0, res.stderr
    said = [line for line in res.stderr.splitlines() if line.startswith("[kda]")]
    assert said[0].startswith("[kda] bazel is missing: installing Debian's bazel-bootstrap "
                              "with apt-get as root"), said
    assert "[kda] apt-get will install 2 packages: openjdk bazel-bootstrap" in said, said
    calls = (bin_dir.parent / "log").read_text().splitlines()
    assert calls[0] == "apt-get update -qq"
    assert calls[1].startswith("apt-get install -s") and \
        calls[2] == "apt-get install -y -qq bazel-bootstrap", calls


def test_bench_without_a_backend_prints_its_usage(bin_dir):
    res = _run(bin_dir, "bench")
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr == ("usage: tools/kda bench <reference|triton|cutedsl|cutedsl_wide|cuda|"
                          "all> [flags]   (flags: tools/kda bench --help)\n")


def test_bench_with_an_unknown_backend_names_it(bin_dir):
    res = _run(bin_dir, "bench", "tensorrt", "--heads=4")
    assert res.returncode == 2
    assert res.stderr.startswith("tools/kda bench: unknown backend 'tensorrt'\nusage: ")


def test_an_unknown_command_is_named(bin_dir):
    res = _run(bin_dir, "bogus")
    assert res.returncode == 2
    assert res.stderr == "tools/kda: unknown command 'bogus'\n"
    assert res.stdout.startswith("The project's front door")


def test_a_kda_python_that_does_not_run_is_said_once(bin_dir, tmp_path):
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "KDA_PYTHON": "/nonexistent/python"}
    res = subprocess.run(["/bin/bash", str(KDA), "serve", "--help"], env=env, text=True,
                         capture_output=True, timeout=60)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr == ("tools/kda: KDA_PYTHON=/nonexistent/python is not a Python interpreter "
                          "that runs (expected e.g. ~/kda-venv/bin/python)\n")


def test_test_with_flags_only_still_tests_every_target(bin_dir):
    _stub(bin_dir, "bazel", 'echo "bazel $*"')
    res = _run(bin_dir, "test", "--test_output=all")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["testlog", "bazel", "test",
                                  f"--repo_env=KDA_PYTHON={bin_dir}/python3",
                                  "--test_output=all", "//..."]
    res = _run(bin_dir, "test", "//tests/kda:config", "--test_output=all")
    assert res.stdout.split()[-2:] == ["//tests/kda:config", "--test_output=all"]


def test_test_in_a_log_runs_bazel_through_testlog_and_on_a_terminal_directly(bin_dir):
    """Output to a log (here a pipe): bazel test through tools/testlog.py, for a progress line
    every few seconds; on a terminal Bazel's own live progress."""
    import pty

    _stub(bin_dir, "bazel", 'echo "bazel $*"; exit 3')
    res = _run(bin_dir, "test", "//tests/kda:config")
    assert (res.returncode, res.stdout.split()[:3]) == (3, ["testlog", "bazel", "test"])
    primary, secondary = pty.openpty()
    try:
        res = _run(bin_dir, "test", "//tests/kda:config", stderr=secondary)
    finally:
        os.close(primary)
        os.close(secondary)
    assert (res.returncode, res.stdout.split()[:2]) == (3, ["bazel", "test"])


def test_help_is_the_whole_comment_at_the_top(bin_dir):
    res = _run(bin_dir, "help")
    lines = res.stdout.splitlines()
    assert res.returncode == 0 and lines[0].startswith("The project's front door")
    assert any(line.strip() == "tools/testlog.py)" for line in lines)
    assert lines[-1] == "(KDA_PYTHON through --repo_env; see third_party/python/python_configure.bzl)."


def test_tune_runs_the_tuner_with_its_flags(bin_dir):
    _stub(bin_dir, "bazel", 'echo "bazel $*" >> "$LOG"')
    res = _run(bin_dir, "tune", "--dry_run", "--heads=12")
    assert res.returncode == 0, res.stderr
    call = (bin_dir.parent / "log").read_text().splitlines()[-1]
    assert call.startswith("bazel run ") and call.endswith("//tools/bench:tune -- --dry_run --heads=12")


def test_bench_refuses_backends_beside_its_positional_backend(bin_dir):
    """``tools/kda bench reference --backends=triton`` measured triton without a word (a CLI
    trial): refused, naming why."""
    res = _run(bin_dir, "bench", "reference", "--heads=4", "--backends=triton")
    assert res.returncode == 2
    assert res.stderr == ("tools/kda bench: 'reference' names the backend; --backends is not "
                          "taken here\n")
    _stub(bin_dir, "bazel", 'echo "bazel $*" >> "$LOG"')
    res = _run(bin_dir, "bench", "all", "--backends=triton,cuda")     # a choice among all
    assert res.returncode == 0, res.stderr
    call = (bin_dir.parent / "log").read_text().splitlines()[-1]
    assert call.endswith("//tools/bench:all_backends -- --backends=triton,cuda")
