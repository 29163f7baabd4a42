"""The backend registry: lazy loading, availability with reasons, support checks, and choice.

Names: ``reference``, ``triton``, ``cutedsl`` (the persistent streamed CuTe DSL kernel),
``cutedsl_wide`` (one CTA per item), ``cuda`` (the CUDA C++ extension), plus ``auto``.

How a call's backend is chosen, first match wins:

1. the ``backend=`` argument of :func:`kda.kda_decode` / :class:`kda.KdaDecode`;
2. the absl flag ``--kda_backend`` when it was given (a server defines it by importing
   :mod:`kda.flags`, which hands its value to :func:`set_flag_source`);
3. the environment variable ``KDA_BACKEND``;
4. ``auto``: the first backend of :func:`kda.auto.auto_order` that is available here and
   supports the configuration, per measured batch size; where that differs between batch
   sizes, a :class:`kda.auto.BatchAuto` whose step runs, per call, the backend chosen for the
   call's batch size.

An explicit name that cannot serve the call raises :class:`KdaBackendError` with every
reason; an unknown name raises listing the valid names. The backend actually used for each
(requested name, configuration) is logged once (logger ``kda``, level INFO).

Built step functions are cached per (backend, configuration, device) (:func:`step_fn`), so
every entry point and ``auto``'s candidates share one build.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from typing import Callable, Dict, List, Optional, Tuple

import torch

from kda.auto import BatchAuto, plan
from kda.backend import Backend, StepFn
from kda.config import KdaConfig
from kda.errors import KdaBackendError

#: Every backend name, in the order the README lists them.
BACKEND_NAMES = ("reference", "triton", "cutedsl", "cutedsl_wide", "cuda")
#: Valid values of the flag / env var / ``backend=`` argument.
CHOICES = ("auto",) + BACKEND_NAMES
_MODULES = {
    "reference": "kda.backends.reference",
    "triton": "kda.backends.triton",
    "cutedsl": "kda.backends.cutedsl",
    "cutedsl_wide": "kda.backends.cutedsl",
    "cuda": "kda.backends.cuda",
}
ENV_VAR = "KDA_BACKEND"

_log = logging.getLogger("kda")
_lock = threading.Lock()
_loaded: Dict[str, Backend] = {}
_logged = set()
#: Returns the --kda_backend flag's value when it was given, else None (see set_flag_source).
_flag_source: Optional[Callable[[], Optional[str]]] = None


def set_flag_source(source: Optional[Callable[[], Optional[str]]]) -> None:
    """Install the function that reads the ``--kda_backend`` flag (:mod:`kda.flags` does, when a
    server imports it); it returns the flag's value when given on the command line, else None."""
    global _flag_source
    _flag_source = source


class _Missing(Backend):
    """Stands in for a backend whose package failed to import."""

    def __init__(self, name: str, reason: str):
        self.name = name
        self.description = "(not importable)"
        self._reason = reason

    def probe(self) -> Optional[str]:
        return self._reason

    def build(self, cfg, device):  # pragma: no cover - never called: unavailable
        raise KdaBackendError(self._reason)


def get_backend(name: str) -> Backend:
    """The :class:`Backend` object named ``name`` (imported on first use).

    Raises:
      KdaBackendError: ``name`` is not a backend name.
    """
    if name not in _MODULES:
        raise KdaBackendError(f"unknown KDA backend {name!r}; valid names: {', '.join(CHOICES)}")
    with _lock:
        if name in _loaded:
            return _loaded[name]
        try:
            mod = importlib.import_module(_MODULES[name])
            objs = getattr(mod, "BACKENDS", None) or (getattr(mod, "BACKEND"),)
            found = {b.name: b for b in objs}
            backend = found[name]
        except Exception as e:  # noqa: BLE001 - any import failure makes it unavailable
            backend = _Missing(name, f"cannot import {_MODULES[name]}: {type(e).__name__}: {e}")
        _loaded[name] = backend
        return backend


def availability(name: str) -> Optional[str]:
    """None when backend ``name`` can run in this process, else why not."""
    try:
        return get_backend(name).availability()
    except KdaBackendError as e:
        return str(e)


def status() -> List[Tuple[str, Optional[str], str]]:
    """[(name, reason it is unavailable or None, description)] for every backend."""
    rows = []
    for name in BACKEND_NAMES:
        b = get_backend(name)
        rows.append((name, b.availability(), b.description))
    return rows


def requested_name(explicit: Optional[str] = None) -> Tuple[str, str]:
    """The backend name requested for a call and where it came from.

    Order: ``explicit`` argument, ``--kda_backend`` flag (if given on the command line),
    ``KDA_BACKEND`` environment variable, else "auto".

    Returns:
      (name, source) with source one of "argument", "flag", "env", "default".
    """
    if explicit is not None:
        if not isinstance(explicit, str):
            check_choice(explicit, "argument")        # not a name: raises, naming it
        return explicit, "argument"
    flag = _flag_source() if _flag_source is not None else None
    if flag is not None:
        return flag, "flag --kda_backend"
    env = os.environ.get(ENV_VAR)
    if env:
        return env.strip(), f"env {ENV_VAR}"
    return "auto", "default"


def unsupported_reasons(name: str, cfg: KdaConfig, device: torch.device) -> List[str]:
    """Why backend ``name`` cannot serve ``cfg`` on ``device`` (empty when it can)."""
    b = get_backend(name)
    why = b.availability()
    if why is not None:
        return [f"unavailable: {why}"]
    return list(b.unsupported(cfg, device))


def check_choice(name, source: str) -> None:
    """``name`` (requested via ``source``, e.g. "argument") is one of :data:`CHOICES`.

    Raises:
      KdaBackendError: it is not (the message lists the valid names).
    """
    if name not in CHOICES:
        hint = ("; 'vllm' is a setting of the vLLM plugin only (vLLM's own kernel there), not a "
                "backend" if name == "vllm" else "")
        raise KdaBackendError(f"unknown KDA backend {name!r} (from {source}); valid names: "
                              f"{', '.join(CHOICES)}{hint}")


def resolve(cfg: KdaConfig, device: torch.device, explicit: Optional[str] = None) -> Backend:
    """Pick the backend for ``cfg`` on ``device`` as the module docstring says.

    Raises:
      KdaBackendError: unknown name (lists the valid ones), or the chosen backend cannot serve
        the call (lists every reason), or no backend at all can (auto; lists each one's reasons).
    """
    name, source = requested_name(explicit)
    check_choice(name, source)
    if name == "auto":
        candidates = {}
        for table_r, order in plan(cfg, device).items():
            ok, tried = [], []
            for cand in order:
                why = unsupported_reasons(cand, cfg, device)
                if why:
                    tried.append(f"{cand}: {'; '.join(why)}")
                else:
                    ok.append(get_backend(cand))
            if not ok:
                raise KdaBackendError(f"no KDA backend can serve {cfg.short()} on {device}: "
                                      + " | ".join(tried))
            candidates[table_r] = ok
        firsts = {c[0].name: c[0] for c in candidates.values()}
        backend = (next(iter(firsts.values())) if len(firsts) == 1
                   else BatchAuto(cfg, candidates, step_fn))
        _log_once(name, source, backend, cfg, device)
        return backend
    why = unsupported_reasons(name, cfg, device)
    if why:
        raise KdaBackendError(f"KDA backend {name!r} (from {source}) cannot serve {cfg.short()} on "
                              f"{device}: {'; '.join(why)}")
    backend = get_backend(name)
    _log_once(name, source, backend, cfg, device)
    return backend


def _log_once(requested: str, source: str, backend: Backend, cfg: KdaConfig,
              device: torch.device) -> None:
    key = (requested, backend.name, cfg, str(device))
    if key in _logged:
        return
    _logged.add(key)
    _log.info("KDA decode backend: %s (requested %s via %s) for %s on %s",
                 describe(backend), requested, source, cfg.short(), device)


def describe(backend: Backend) -> str:
    """The backend's name, with the plan for ``auto`` when it depends on the batch size."""
    return backend.name if backend.name != "auto" else f"auto ({backend.description})"


_steps: Dict[tuple, StepFn] = {}


def step_fn(backend: Backend, cfg: KdaConfig, device: torch.device) -> StepFn:
    """``backend``'s built step for ``cfg`` on ``device``: built on first need, then cached
    for the process (shared by every entry point and by ``auto``'s candidates)."""
    key = (getattr(backend, "cache_key", backend.name), cfg, str(device))
    fn = _steps.get(key)
    if fn is None:
        with _build_lock:
            fn = _steps.get(key)
            if fn is None:
                fn = backend.build(cfg, device)
                _steps[key] = fn
    return fn


_build_lock = threading.RLock()   # auto's build builds its candidates through step_fn
