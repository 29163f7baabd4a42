"""The cuda backend's host-side settings, on the CPU (no GPU, no nvcc needed)."""

import pytest

from kda.backends.cuda.backend import (FB_SMEM, SCHEDULE, STATIC_FRACTION, schedule_from_env,
                                   static_fraction_from_env)
from kda.backend import flag_from_env


def test_schedule_env_is_checked(monkeypatch):
    monkeypatch.delenv("KDA_CUDA_SCHEDULE", raising=False)
    assert schedule_from_env("dynamic") == "dynamic"
    monkeypatch.setenv("KDA_CUDA_SCHEDULE", "greedy")
    with pytest.raises(ValueError, match="KDA_CUDA_SCHEDULE must be one of"):
        schedule_from_env("static")
    monkeypatch.setenv("KDA_CUDA_SCHEDULE", " Static ")
    assert schedule_from_env("dynamic") == "static"


def test_default_schedule_by_T():
    """Dynamic everywhere (docs/results/2026-11-29-h200-1b62e9a for T >= 2); at T=1 after
    static ranges of 0.8 of each CTA's share (docs/results/2026-11-29-h200-8155583)."""
    assert all(SCHEDULE.get(t, "dynamic") == "dynamic" for t in range(1, 9))
    assert STATIC_FRACTION.get(1, 0.0) == 0.8
    assert all(STATIC_FRACTION.get(t, 0.0) == 0.0 for t in range(2, 9))


def test_fb_smem_env_is_checked(monkeypatch):
    monkeypatch.delenv("KDA_CUDA_FB_SMEM", raising=False)
    assert flag_from_env("KDA_CUDA_FB_SMEM", True) is True
    assert flag_from_env("KDA_CUDA_FB_SMEM", False) is False
    monkeypatch.setenv("KDA_CUDA_FB_SMEM", "0")
    assert flag_from_env("KDA_CUDA_FB_SMEM", True) is False
    monkeypatch.setenv("KDA_CUDA_FB_SMEM", " 1 ")
    assert flag_from_env("KDA_CUDA_FB_SMEM", False) is True
    monkeypatch.setenv("KDA_CUDA_FB_SMEM", "yes")
    with pytest.raises(ValueError, match="KDA_CUDA_FB_SMEM must be 0 or 1"):
        flag_from_env("KDA_CUDA_FB_SMEM", False)


def test_default_fb_smem():
    """On (docs/results/2026-11-29-h200-e1356bb: 4-6% faster at T=1)."""
    assert FB_SMEM is True


def test_static_fraction_env_is_checked(monkeypatch):
    monkeypatch.delenv("KDA_CUDA_STATIC_FRACTION", raising=False)
    assert static_fraction_from_env(0.25) == 0.25
    monkeypatch.setenv("KDA_CUDA_STATIC_FRACTION", " 0.8 ")
    assert static_fraction_from_env(0.0) == 0.8
    for bad in ("1.5", "-0.1", "nan", "half"):
        monkeypatch.setenv("KDA_CUDA_STATIC_FRACTION", bad)
        with pytest.raises(ValueError, match="KDA_CUDA_STATIC_FRACTION must be a number in"):
            static_fraction_from_env(0.0)
