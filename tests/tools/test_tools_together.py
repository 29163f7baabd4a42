"""The tools' absl flags can live in one process (``python3 -m pytest tests`` imports them all)."""

from absl import flags


def test_bench_and_serve_import_together():
    from tools.bench import bench  # noqa: F401
    from tools.bench import cuda_trace  # noqa: F401
    from tools.serve import serve  # noqa: F401
    names = set(flags.FLAGS)
    assert {"gate_mode", "kda_backend", "backends", "spec_tokens", "trace_steps"} <= names
