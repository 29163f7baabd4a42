"""The vLLM plugin's setting and its register-on-import hook, without vLLM (default suite).

The layers themselves run against the real vLLM in test_vllm.py (tools/vllm/run_tests.sh).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import re
import sys

import pytest

import kda
from kda.integrations import vllm as plugin

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VLLM_VERSION = plugin.vllm_version          # the real one (the fixture below stands in)


@pytest.fixture(autouse=True)
def tested_vllm(monkeypatch):
    """As under a tested vLLM (whatever is installed here; tests of other versions set theirs)."""
    monkeypatch.setattr(plugin, "vllm_version", lambda: plugin.TESTED_VLLM_VERSIONS[-1])
    monkeypatch.setattr(plugin, "_logged", set())


@pytest.fixture
def vllm_log():
    """Records as vLLM's configured logging receives them: a handler on the ``vllm`` logger,
    which does not propagate (vLLM's ``DEFAULT_LOGGING_CONFIG``)."""
    records = []
    handler = logging.Handler(level=logging.DEBUG)
    handler.emit = records.append
    logger = logging.getLogger("vllm")
    old = (logger.propagate, logger.level)
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)          # setLevel: also clears the loggers' level caches
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.propagate = old[0]
        logger.setLevel(old[1])


def test_import_does_not_import_vllm():
    import subprocess
    code = ("import sys, kda.integrations.vllm as p; assert 'vllm' not in sys.modules; "
            "assert not any(m.startswith('kda.integrations._vllm') for m in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("value", list(kda.registry.CHOICES) + ["vllm"])
def test_every_valid_value_is_accepted(value, monkeypatch):
    monkeypatch.delenv("KDA_BACKEND", raising=False)
    assert plugin.backend_choice({plugin.CONFIG_KEY: value}) == (
        value, f"--additional-config {plugin.CONFIG_KEY}")


def test_blanks_around_a_value_do_not_count_in_either_source(monkeypatch):
    monkeypatch.delenv("KDA_BACKEND", raising=False)
    assert plugin.backend_choice({plugin.CONFIG_KEY: " auto "})[0] == "auto"
    monkeypatch.setenv("KDA_BACKEND", " vllm ")
    assert plugin.backend_choice(None)[0] == "vllm"


def test_a_misspelled_key_is_warned_about_once(monkeypatch, vllm_log):
    monkeypatch.delenv("KDA_BACKEND", raising=False)
    for _ in range(2):
        assert plugin.backend_choice({"kda_fused_backend": "cuda",
                                      "kda_decode_backend": "native"}) == ("auto", "default")
    warned = [r.getMessage() for r in vllm_log if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned
    assert "'kda_fused_backend'" in warned[0] and repr(plugin.CONFIG_KEY) in warned[0]
    assert "'kda_decode_backend'" not in warned[0].split("vLLM's own")[0]
    plugin.backend_choice({plugin.CONFIG_KEY: "cuda", "kda_spec_decode_backend": "triton"})
    assert len([r for r in vllm_log if r.levelno == logging.WARNING]) == 1


def test_order_key_then_env_then_auto(monkeypatch):
    monkeypatch.setenv("KDA_BACKEND", "triton")
    assert plugin.backend_choice({plugin.CONFIG_KEY: "cuda"})[0] == "cuda"
    assert plugin.backend_choice({"kda_decode_backend": "native"}) == ("triton", "$KDA_BACKEND")
    monkeypatch.setenv("KDA_BACKEND", "vllm")
    assert plugin.backend_choice(None) == ("vllm", "$KDA_BACKEND")
    monkeypatch.delenv("KDA_BACKEND")
    assert plugin.backend_choice({}) == ("auto", "default")


@pytest.mark.parametrize("value", ["fastest", "native", 3, ""])
def test_an_unknown_value_names_the_setting_the_valid_values_and_the_value(value, monkeypatch):
    monkeypatch.delenv("KDA_BACKEND", raising=False)
    with pytest.raises(kda.KdaBackendError) as e:
        plugin.backend_choice({plugin.CONFIG_KEY: value})
    msg = str(e.value)
    assert plugin.CONFIG_KEY in msg and repr(value) in msg
    for name in plugin.setting_values():
        assert name in msg


def test_the_choice_is_logged_once_into_vllms_log(vllm_log):
    """The plugin's logger is a child of vLLM's ``vllm`` logger: its lines reach the handler
    vLLM configures there (and nothing else of the process's logging is needed)."""
    assert plugin.LOGGER_NAME.startswith("vllm.")
    for _ in range(3):
        plugin.backend_choice({plugin.CONFIG_KEY: "vllm"})
    msgs = [r.getMessage() for r in vllm_log if "vLLM's own path" in r.getMessage()]
    assert len(msgs) == 1, msgs
    assert vllm_log[0].levelno == logging.INFO and vllm_log[0].name == plugin.LOGGER_NAME


@pytest.mark.parametrize("given", [None, "auto", "vllm"])
def test_an_untested_vllm_version(given, monkeypatch, vllm_log):
    """vLLM 0.99: the default keeps every layer on vLLM's path; a setting given is kept. One
    warning either way (none when the setting keeps vLLM's path anyway)."""
    monkeypatch.setattr(plugin, "vllm_version", lambda: "0.99.0")
    monkeypatch.delenv("KDA_BACKEND", raising=False)
    config = {} if given is None else {plugin.CONFIG_KEY: given}
    for _ in range(2):
        name, source = plugin.backend_choice(config)
    assert name == (given or "vllm")
    assert "untested vLLM 0.99.0" in source if given is None else source.startswith("--")
    warnings = [r.getMessage() for r in vllm_log if r.levelno == logging.WARNING]
    if given == "vllm":
        assert warnings == []
    else:
        (msg,) = warnings
        assert "vLLM 0.99.0" in msg and ", ".join(plugin.TESTED_VLLM_VERSIONS) in msg
        assert plugin.CONFIG_KEY in msg if given is None else repr(given) in msg


def test_vllm_version_drops_the_local_part(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.34.0+cu130")
    assert VLLM_VERSION() == "0.34.0"

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert VLLM_VERSION() is None


def test_the_engine_script_has_each_tested_versions_dependencies():
    """tools/vllm/run_tests.sh runs every tested version, each with its own pins."""
    script = open(os.path.join(ROOT, "tools", "vllm", "run_tests.sh")).read()
    cases = re.findall(r"^\s+(\d+\.\d+\.\d+)\) echo ", script, re.M)
    assert sorted(cases) == sorted(plugin.TESTED_VLLM_VERSIONS)
    assert "TESTED_VLLM_VERSIONS" in script


def test_a_deferred_model_registers_when_its_module_is_imported(tmp_path, monkeypatch):
    """The hook registers a model right after the import system ran its module, once, and
    leaves every other module alone."""
    (tmp_path / "kda_fake_engine_layer.py").write_text("VALUE = 41 + 1\n")
    (tmp_path / "kda_fake_other.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    monkeypatch.setattr(plugin, "_register_model",
                        lambda m: seen.append((m.name, sys.modules[m.vllm_module].VALUE)))
    model = plugin.Model("Fake", "kda_fake_engine_layer", "FakeLayer", "nowhere", "KdaFake",
                         deferred=True)
    hook = plugin._RegisterOnImport()
    monkeypatch.setattr(sys, "meta_path", [hook] + sys.meta_path)
    hook.add(model)
    assert hook.pending() == ("kda_fake_engine_layer",)
    importlib.import_module("kda_fake_other")
    assert seen == []
    mod = importlib.import_module("kda_fake_engine_layer")
    assert seen == [("Fake", 42)] and mod.VALUE == 42
    assert hook.pending() == ()
    importlib.reload(mod)                       # the module's own loader still works
    assert seen == [("Fake", 42)]
    for name in ("kda_fake_engine_layer", "kda_fake_other"):
        sys.modules.pop(name, None)


def test_layer_class_names_the_models():
    with pytest.raises(KeyError, match="Kimi-Linear"):
        plugin.layer_class("Qwen")
    assert set(plugin.MODELS) == {"Kimi-Linear", "Kimi-K3", "GLM-5-Next"}
