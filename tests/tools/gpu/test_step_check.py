"""``tools.gpu.step_check`` refuses what it cannot run with a message naming it, before any
step: arguments, a schedule name, a schedule that cannot serve one of its two steps, a
machine without a GPU."""

import pytest
import torch

from tools.gpu import step_check


@pytest.mark.parametrize("argv,msg", [
    ([], "expected BACKEND HEADS REQUESTS TOKENS"),
    (["cutedsl", "8", "x", "1"], "expected BACKEND HEADS REQUESTS TOKENS"),
    (["cutedsl", "0", "3", "1"], "expected integers >= 1"),
    (["cutedsl", "4", "0", "1"], "expected integers >= 1"),
    (["cutedsl", "4", "3", "0"], "expected integers >= 1"),
    (["cutedsl", "8", "100", "1", "fp16"], "a state dtype (fp32 or bf16)"),
    (["cutedsl:stream4+bogus", "8", "100", "1"], "schedule name: expected one of"),
    (["cutedsl:stream4+gb", "8", "100", "1", "fp32", "record"],
     "gate_batch serves T = 1 without record mode"),
    (["cutedsl:split2+direct", "4", "3", "2"], "expected one of"),
])
def test_refused_with_a_message(argv, msg, capsys):
    assert step_check.main(argv) == 2
    assert msg in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the step would run")
def test_no_gpu(capsys):
    assert step_check.main(["cutedsl:stream4+gb", "8", "100", "1"]) == 2
    assert "none here" in capsys.readouterr().err
