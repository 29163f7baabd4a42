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
