"""``backends/cutedsl/backend.py`` without CuTe DSL: the warning for an nvidia-cutlass-dsl
release other than the one the kernels are tested with (vLLM brings its own)."""

from kda.backends.cutedsl import backend


def test_another_cute_dsl_release_is_named_with_the_tested_one():
    assert backend.version_note(backend.TESTED_CUTE_DSL) is None
    assert backend.version_note(backend.TESTED_CUTE_DSL + "+local") is None
    assert backend.version_note(None) is None
    note = backend.version_note("4.8.0")
    assert note.startswith("nvidia-cutlass-dsl 4.8.0 is installed")
    assert f"tested with {backend.TESTED_CUTE_DSL}" in note


def test_the_tested_release_is_the_extras_pin():
    import os
    import re
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    with open(os.path.join(root, "pyproject.toml")) as f:
        pin = re.search(r'cutedsl = \["nvidia-cutlass-dsl==([^"]+)"\]', f.read()).group(1)
    assert pin == backend.TESTED_CUTE_DSL
