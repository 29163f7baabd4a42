"""The serve tool end to end on a small configuration: prefill with fla-core, continuous
batching with null-slot padding, plain decode and speculative verify, the check against
fla-core over whole sequences, and step-for-step agreement with the reference backend."""

import pytest
from absl import flags
from absl.testing import flagsaver

from tools.serve import serve

FLAGS = flags.FLAGS


@pytest.fixture(autouse=True)
def parsed(tmp_path, monkeypatch):
    monkeypatch.setenv("KDA_CACHE_DIR", str(tmp_path))
    FLAGS.unparse_flags()
    FLAGS(["serve"])
    yield
    FLAGS.unparse_flags()


@pytest.mark.parametrize("T", [1, 3])
def test_serve_small(T, capsys):
    with flagsaver.flagsaver(num_heads=2, tp_rank=5, num_requests=5, max_batch=4, spec_tokens=T,
                             prompt_len="3:9", gen_len="2:6", check_against="reference",
                             lower_bound=-5.0 if T == 3 else None):
        rc = serve.main(["serve"])
    out = capsys.readouterr().out
    assert "CHECK PASSED" in out, out
    assert "heads [10, 12) of 32" in out
    assert rc == 0


def test_serve_bf16_state(capsys):
    """--state_dtype=bf16: a bf16 state pool through continuous batching and speculative
    verify, step for step as the reference and within the fla-core check."""
    with flagsaver.flagsaver(num_heads=2, num_requests=4, max_batch=3, spec_tokens=3,
                             prompt_len="3:9", gen_len="2:6", check_against="reference",
                             state_dtype=["bf16"]):
        rc = serve.main(["serve"])
    out = capsys.readouterr().out
    assert "CHECK PASSED" in out, out
    assert "st16" in out
    assert rc == 0
