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
def test_serve_small(T, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")        # rich's width in a log
    with flagsaver.flagsaver(num_heads=2, tp_rank=5, num_requests=5, max_batch=4, spec_tokens=T,
                             prompt_len="3:9", gen_len="2:6", check_against="reference",
                             lower_bound=-5.0 if T == 3 else None):
        rc = serve.main(["serve"])
    out = capsys.readouterr().out
    assert "CHECK PASSED" in out, out
    assert "heads [10, 12) of 32" in out
    assert rc == 0
    # the verdict is one line in a log (rich wrapped it at 80 columns), for a grep to find
    assert "CHECK PASSED (every generated token vs fla-core over the whole sequence; limit " \
        "rel 0.05)" in out.splitlines()
    # the synthetic checkpoint is written once, into $KDA_CACHE_DIR/checkpoints/
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == \
        ["kimi_linear_kda_layer_SYNTHETIC_seed0.safetensors"]


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


def test_serve_shadow_pool_error_table(tmp_path, capsys):
    """--shadow_state_dtype / --error_json: every step also decoded on an fp32 shadow pool;
    the per-position table compares each generated token with fla-core, with the shadow's
    token, and the shadow's with fla-core, over every generated token exactly once."""
    import json

    path = tmp_path / "err.json"
    with flagsaver.flagsaver(num_heads=2, num_requests=3, max_batch=2, spec_tokens=2,
                             prompt_len="3:5", gen_len="20:20", state_dtype=["bf16"],
                             shadow_state_dtype="fp32", error_json=str(path)):
        rc = serve.main(["serve"])
    out = capsys.readouterr().out
    assert rc == 0 and "CHECK PASSED" in out, out
    assert "every step also decoded on a fp32 state pool" in out
    got = json.loads(path.read_text())
    assert (got["state_dtype"], got["shadow_state_dtype"]) == ("bf16", "fp32")
    rows = got["by_position"]
    assert [(r["lo"], r["hi"]) for r in rows] == [(1, 16), (17, 64)]
    assert [r["tokens"] for r in rows] == [3 * 16, 3 * 4]          # 3 requests x 20 tokens
    for r in rows:
        for what in ("fla-core", "shadow", "shadow vs fla-core"):
            e = r[what]
            assert 0 < e["median"] <= e["p99"] <= e["max"] < 0.05, (r, what)


def test_serve_without_shadow_writes_fla_core_only(tmp_path, capsys):
    import json

    path = tmp_path / "err.json"
    with flagsaver.flagsaver(num_heads=2, num_requests=2, max_batch=2, prompt_len="3:5",
                             gen_len="4:6", error_json=str(path)):
        assert serve.main(["serve"]) == 0
    got = json.loads(path.read_text())
    assert got["shadow_state_dtype"] is None
    assert set(got["comparisons"]) == {"fla-core"}
    assert 8 <= got["by_position"][0]["tokens"] <= 12      # 2 requests x 4..6 tokens
