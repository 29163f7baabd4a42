"""The tools' absl flags can live in one process (``python3 -m pytest tests`` imports them all)."""

from absl import flags


def test_bench_and_serve_import_together():
    from tools.bench import bench  # noqa: F401
    from tools.serve import serve  # noqa: F401
    names = set(flags.FLAGS)
    assert {"gate_mode", "kda_backend", "backends", "spec_tokens"} <= names


def test_path_flags_are_relative_to_the_users_directory(monkeypatch, tmp_path):
    """Under tools/kda serve / bench (bazel run) a relative --checkpoint / --out_dir / --out
    means the directory the command was started in (KDA_USER_DIR, BUILD_WORKING_DIRECTORY),
    not the tool's runfiles tree (found by a new-user trial: the checkpoint was not found, the
    bench JSON landed under bazel-bin)."""
    from tools.flags import user_path
    monkeypatch.delenv("BUILD_WORKING_DIRECTORY", raising=False)
    monkeypatch.delenv("KDA_USER_DIR", raising=False)
    assert user_path("out") == "out" and user_path("") == ""
    monkeypatch.setenv("BUILD_WORKING_DIRECTORY", str(tmp_path))
    assert user_path("out/x.json") == str(tmp_path / "out" / "x.json")
    assert user_path("/abs/ck.safetensors") == "/abs/ck.safetensors" and user_path("") == ""
    monkeypatch.setenv("KDA_USER_DIR", str(tmp_path / "u"))      # tools/kda's, which wins
    assert user_path("out") == str(tmp_path / "u" / "out")


def test_help_exits_0_with_the_tools_usage_and_no_module_path(monkeypatch, capsys):
    """--help (and -h, --helpshort) print the tool's docstring and its flags on stdout and exit
    0; absl's own exits 1 and heads the flags with the main module's file (under bazel run a
    runfiles path)."""
    import sys
    import types

    import pytest
    from tools.flags import parse_flags
    main = types.ModuleType("__main__", "Usage: tools/kda frob [flags]\n\nFrobs.")
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", ["/some/runfiles/tools/frob.py"])
    flags.DEFINE_integer("frob_level", 3, "how hard to frob", module_name=sys.argv[0])
    try:
        for arg in ("--help", "-h", "--helpshort"):
            with pytest.raises(SystemExit) as ei:
                parse_flags([sys.argv[0], "--frob_level=2", arg])
            assert ei.value.code == 0
            out = capsys.readouterr().out
            assert out.startswith("Usage: tools/kda frob [flags]\n\nFrobs.\n\nflags:\n"), out
            assert "--frob_level: how hard to frob" in out
            assert "--kda_backend" in out and "--gate_mode" in out      # the project's modules
            assert "/some/runfiles" not in out and "absl.logging" not in out
        # after "--" it is an argument of the tool's, not a help request
        assert parse_flags([sys.argv[0], "--", "--help"]) == [sys.argv[0], "--help"]
    finally:
        flags.FLAGS.unparse_flags()
        delattr(flags.FLAGS, "frob_level")


def test_other_packages_warnings_show_only_when_asked():
    """Below -v 1 a warning from another package's module (fla-core's platform warning) is
    not shown, the project's own are; with -v 1 both are."""
    import warnings
    from tools.flags import quiet_third_party_warnings

    def shown(verbosity):
        with warnings.catch_warnings(record=True) as got:
            warnings.resetwarnings()
            quiet_third_party_warnings(verbosity)
            for module in ("fla.utils.hardware", "kda.registry", "tools.serve.serve"):
                warnings.warn_explicit(f"from {module}", UserWarning, "f.py", 1, module=module)
        return sorted(str(w.message) for w in got)

    assert shown(0) == ["from kda.registry", "from tools.serve.serve"]
    assert shown(1) == ["from fla.utils.hardware", "from kda.registry", "from tools.serve.serve"]
