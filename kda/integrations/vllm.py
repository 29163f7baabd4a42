"""vLLM plugin: the KDA decode and speculative-verify batches of vLLM's KDA layers through :class:`kda.KdaDecode`.

Install this distribution next to vLLM (tested: :data:`TESTED_VLLM_VERSIONS`) and vLLM loads
:func:`register` from the ``vllm.general_plugins`` entry point (pyproject.toml) in every
process. ``register`` replaces three of vLLM's KDA layer classes by subclasses, through vLLM's
``PluggableLayer.register_oot`` (keyed by the class's name): constructing vLLM's class then
yields the subclass.

* Kimi-Linear: ``KimiGatedDeltaNetAttention``
  (``vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn``; Alice-AI's model uses it
  too) -> ``KdaKimiGatedDeltaNetAttention`` (``kda.integrations._vllm_kimi_linear``);
* Kimi-K3: ``KimiK3DeltaAttention`` (``vllm.models.kimi_k3.nvidia.kda``) ->
  ``KdaKimiK3DeltaAttention`` (``kda.integrations._vllm_kimi_k3``);
* GLM-5-Next, the layer of GLM-5.3-Flash: ``Glm5NextLinearAttention``
  (``vllm.models.glm5next.common.kda``) -> ``KdaGlm5NextLinearAttention``
  (``kda.integrations._vllm_glm5next``).

Kimi-Linear's class is registered when ``register`` runs; the Kimi-K3 and GLM-5-Next classes
when vLLM itself imports their module (an import hook on exactly those two module names; at
once when they are already imported), so a process serving another model never imports
them. Kimi-K3's is not registered on ROCm or TPU: there vLLM builds the class of the same name
in ``vllm.models.kimi_k3.amd`` (or a plugin's), which a subclass of the NVIDIA class must not
stand in for.

What each subclass does
-----------------------
``forward`` runs vLLM's projections as vLLM does, except that it keeps ``f_a`` instead of
projecting it through ``f_b_proj`` (the op fuses that low-rank GEMM), allocates the
attention output ``core_attn_out`` as vLLM's ``forward`` does, and hands it with the slices of
the packed projection output to ``_kda_forward`` (``kda.integrations._vllm_layer``), which,
like vLLM's ``_forward``, is decorated ``@eager_break_during_capture`` and writes
``core_attn_out`` in place and returns nothing. (Under vLLM's breakable CUDA graphs, the
default for these models, that function runs eagerly at every replay between captured
segments; the ``o_proj`` segment after it reads the buffer allocated before it, at the address
it had at capture.) There:

* a **pure-decode batch** (no prefill, no speculative request) and a **uniform
  speculative-verify batch** (no prefill or plain decode, every request
  ``T = num_speculative_tokens + 1`` tokens) run one ``KdaDecode`` step on vLLM's own tensors:
  the q|k|v, beta and f_a column slices of the packed projection (no copy), the output gate,
  ``f_b_proj.weight``, the conv cache (SD: vLLM's ``.transpose(-1, -2)`` view, DS: as is), the
  state pool (fp32 or bf16), the slot table (null block 0) and ``num_accepted_tokens``. The
  op writes the gated-RMSNorm output into ``core_attn_out``, so ``o_norm`` is skipped. It
  serves exactly the requests vLLM's kernels would (the rows past them are left as vLLM
  leaves them, unused);
* **every other batch** computes ``f_b_proj(f_a)`` and calls vLLM's own ``_forward`` body
  (and GLM-5-Next's ``o_norm``, which vLLM applies after it) unchanged: prefill and mixed
  batches, ragged speculative batches (requests with fewer drafts than configured, dynamic
  speculation), plain decodes beside speculative ones, and verify batches under adaptive
  verification (vLLM trims each request's drafts on the device, so the host cannot know that
  a batch is uniform). ``layer.kda_last_path`` says which path the last call took.

A layer whose setup the op does not serve runs vLLM's own ``forward`` for every batch: a
recurrent state other than fp32 / bf16, a quantized ``f_b_proj``, ReplaySSM / RecoverSSM, a
model dtype other than bf16, a head dim other than 128 or conv other than 4 taps, ROCm unless
a backend is named (the op's GPU backends target NVIDIA GPUs). Arguments the op's validation
refuses, and ``auto`` finding no GPU backend (on a GPU it does not serve, or on a platform
without one: vLLM's CPU or XPU platform; ``auto`` would run the PyTorch reference there) leave
that configuration on vLLM's path with a warning.

Where the op replaces vLLM's kernels
------------------------------------
With ``auto`` the op replaces vLLM's Triton decode / verify chains: separate launches for the
conv update, the recurrence and ``o_norm`` (and the ``f_b`` GEMM before them), which the op
fuses into one. It keeps vLLM's own single-launch fused kernels, against which no measurement
of the op is recorded: Kimi-K3's native CUDA ``fused_kda_decode`` (vLLM's choice for Kimi-K3
decode on SM90 / SM10x / SM12x with an fp32 pool and no speculation) and FlashInfer's fused
decode and packed verify; those batches stay on vLLM's path, said once in the log. A backend
named in the setting replaces them too. The log names, once per model and kind of batch, the
vLLM kernels the op replaces and the backend it runs.

The log
-------
Every decision is logged once per process and reason, on the logger :data:`LOGGER_NAME`, a
child of vLLM's ``vllm`` logger: its lines reach wherever vLLM's own go (vLLM's handler,
format and ``VLLM_LOGGING_LEVEL``; vLLM's ``vllm`` logger does not propagate further). INFO:
the setting and where it came from, each class replaced, each path and the kernels the op
replaces (with the backend it runs), each reason a layer or a kind of batch stays on vLLM's
path. WARNING: an untested vLLM version, arguments the op refuses, ``auto`` without a GPU
backend.

vLLM versions
-------------
Tested against :data:`TESTED_VLLM_VERSIONS`. Under any other version (read from the installed
``vllm`` distribution) a process whose setting is the default logs one warning and keeps every
KDA layer on vLLM's own path; a setting given explicitly (``--additional-config`` or
``$KDA_BACKEND``) runs the op, also with that warning. Differences between the tested
versions the subclasses follow: GLM-5-Next's q / k / v convs are three parameters in 0.33 and
one merged ``conv1d`` in 0.34; Kimi-Linear's prefill stores the chunk kernel's fp32 final
state into the pool by index assignment in 0.33, which fails on a bf16 pool, and through
``scatter_states`` (a store that converts to the pool's dtype) in 0.34 (see
``--mamba-ssm-cache-dtype`` below); adaptive verification reaches the GDN builder of
Kimi-Linear and GLM-5-Next in 0.34.

How each model maps onto the op (docs/contract.md)
-------------------------------------------------
* **Kimi-Linear**: softplus gate (``lower_bound=None``) or, with ``gate_lower_bound`` in its
  config, the bounded gate; output gate ``g_b_proj(g_a_proj(h))`` (or the full-rank slice of
  the packed projection), computed as vLLM does and passed as ``output_gate``; beta raw logits;
  ``o_norm.eps``. The layer's ``get_state_dtype`` here passes ``--mamba-ssm-cache-dtype``
  through (vLLM's class drops it, so its pool stays fp32 while the model's
  ``get_mamba_state_dtype_from_config`` says bf16): ``bfloat16`` gives a bf16 pool, on vLLM's
  path too. Under vLLM 0.33, whose Kimi-Linear prefill cannot store into a bf16 pool, a bf16
  pool is refused at layer construction (model build, i.e. startup) with an error naming
  ``--mamba-ssm-cache-dtype``.
* **Kimi-K3**: the bounded gate with the config's ``gate_lower_bound`` (softplus without one),
  the full-rank output-gate slice of the packed projection, beta raw logits, ``o_norm.eps``.
  Under CUDA-graph capture vLLM computes the in-projection and the ``f_b`` GEMM on an
  auxiliary stream (TP 8); the subclass computes the in-projection alone (the op fuses the
  ``f_b`` GEMM) and, on vLLM's path, ``f_b_proj(f_a)`` inside the eager segment. Its
  ``gemm_rs_ar`` ``o_proj`` is kept. vLLM's kernel choice (``kda_decode_backend``,
  ``kda_spec_decode_backend``) decides which of its fused kernels ``auto`` keeps (above).
  RecoverSSM (``--use-replayssm``) keeps the layer on vLLM's path.
* **GLM-5-Next** (GLM-5.3-Flash): the bounded gate ``linear_lower_bound * sigmoid(exp(A_log) *
  (f_b(f_a) + dt_bias))`` (vLLM's kernels have no other gate); ``A_log`` ``[1, 1, H, 1]``
  viewed as ``[H]``; the q / k / v conv weights laid out once as the op's ``[3, 4, dim]``; the
  output gate ``g_b_proj(g_a)``, a low-rank projection computed as vLLM does and passed as
  ``output_gate``; beta raw logits; ``o_norm.eps``. A lower bound outside the contract's
  [-5, 0) stays on vLLM's path (the op's validation refuses it, logged).

The conv weight is re-laid out once to the op's ``[3, 4, dim]`` fp32 (in
``process_weights_after_loading``, which vLLM's loader calls after loading and reloading
weights, else lazily on first use; not for a layer the setting keeps on vLLM's path) and
cached on the layer; code that rewrites a conv weight in place without vLLM's loader must call
``layer.process_weights_after_loading()`` after it.
One ``KdaDecode`` per layer and configuration (T, window, conv layout, dtypes) is built on
first use (vLLM's warm-up runs, before CUDA-graph capture) and reused. Nothing is copied
except a non-contiguous slot table (a column slice of vLLM's block table: R or R*T int32);
nothing is read from the device on the host; the op never synchronizes.

Choosing the backend (one setting per process)
----------------------------------------------
``--additional-config '{"kda_fused_decode_backend": "<value>"}'``, else ``$KDA_BACKEND``, else
``auto``. ``<value>`` is one of :data:`kda.registry.CHOICES` or ``"vllm"``, which keeps every
KDA layer of the process on vLLM's own path. Any other value raises at layer construction
(model build, i.e. startup) listing the valid values. The key is deliberately not vLLM's
``kda_decode_backend`` / ``kda_spec_decode_backend``: Kimi-K3's layer reads those (auto /
native / flashinfer / triton) and they keep that meaning, choosing vLLM's kernel wherever
vLLM's path runs.

Tests: ``tools/vllm/run_tests.sh`` (tests/integrations/test_vllm.py, against each tested
version). This module imports vLLM only inside functions, so ``import kda.integrations.vllm``
works without vLLM; ``import kda`` never imports this module.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.metadata
import logging
import os
import sys
import threading
from typing import Dict, NamedTuple, Optional, Tuple

#: The ``--additional-config`` key that picks the backend.
CONFIG_KEY = "kda_fused_decode_backend"
#: vLLM's own ``--additional-config`` keys of KDA layers (Kimi-K3's kernel choice), which
#: keep their meaning; any other key that names ``kda`` is warned about as a likely misspelling
#: of :data:`CONFIG_KEY`.
VLLM_KDA_KEYS = ("kda_decode_backend", "kda_spec_decode_backend")
#: The setting's value that keeps every KDA layer on vLLM's own path.
VLLM_PATH = "vllm"
#: The vLLM releases the plugin is tested against (``tools/vllm/run_tests.sh`` runs each).
TESTED_VLLM_VERSIONS: Tuple[str, ...] = ("0.33.0", "0.34.0")
#: The plugin's logger: a child of vLLM's ``vllm`` logger, so that its lines go where vLLM's go.
LOGGER_NAME = "vllm.plugins.kda"

_log = logging.getLogger(LOGGER_NAME)
_lock = threading.RLock()
_registered = False
_logged: set = set()


class Model(NamedTuple):
    """One vLLM KDA layer class the plugin replaces."""

    name: str            # the model's name in logs and docs
    vllm_module: str     # where vLLM defines the class
    vllm_class: str      # its name: the ``op_registry_oot`` key
    module: str          # where the subclass is defined
    cls: str             # the subclass's name
    deferred: bool       # registered when vLLM imports ``vllm_module`` (else in ``register``)


#: The replaced classes, by model.
MODELS: Dict[str, Model] = {
    "Kimi-Linear": Model("Kimi-Linear", "vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn",
                         "KimiGatedDeltaNetAttention", "kda.integrations._vllm_kimi_linear",
                         "KdaKimiGatedDeltaNetAttention", deferred=False),
    "Kimi-K3": Model("Kimi-K3", "vllm.models.kimi_k3.nvidia.kda", "KimiK3DeltaAttention",
                     "kda.integrations._vllm_kimi_k3", "KdaKimiK3DeltaAttention", deferred=True),
    "GLM-5-Next": Model("GLM-5-Next", "vllm.models.glm5next.common.kda", "Glm5NextLinearAttention",
                        "kda.integrations._vllm_glm5next", "KdaGlm5NextLinearAttention",
                        deferred=True),
}
#: vLLM's name of Kimi-Linear's class (kept for callers of the first plugin version).
VLLM_CLASS = MODELS["Kimi-Linear"].vllm_class


def log_once(key, level: int, msg: str, *args) -> None:
    """Log ``msg % args`` on :data:`LOGGER_NAME` the first time ``key`` is seen in this process."""
    with _lock:
        if key in _logged:
            return
        _logged.add(key)
    _log.log(level, msg, *args)


def setting_values() -> Tuple[str, ...]:
    """The valid values of the setting: :data:`kda.registry.CHOICES` and :data:`VLLM_PATH`."""
    from kda import registry
    return registry.CHOICES + (VLLM_PATH,)


def vllm_version() -> Optional[str]:
    """The installed ``vllm`` distribution's version without its local part (``0.34.0`` for
    ``0.34.0+cu130``), or None when vLLM is not installed."""
    try:
        return importlib.metadata.version("vllm").split("+", 1)[0]
    except importlib.metadata.PackageNotFoundError:
        return None


def tested_vllm() -> bool:
    """Whether the installed vLLM is one of :data:`TESTED_VLLM_VERSIONS` (or none is
    installed)."""
    version = vllm_version()
    return version is None or version in TESTED_VLLM_VERSIONS


def backend_choice(additional_config=None) -> Tuple[str, str]:
    """The setting's value for this process, and where it came from.

    Order: ``additional_config[CONFIG_KEY]`` (vLLM's ``--additional-config``), then
    ``$KDA_BACKEND``, then ``"auto"``. The value is a backend name for :class:`kda.KdaDecode`
    or :data:`VLLM_PATH` (every layer on vLLM's path). Under a vLLM version outside
    :data:`TESTED_VLLM_VERSIONS` the default is :data:`VLLM_PATH` instead of ``"auto"``, and
    the version is warned about once per process (also when a given setting asks for the op).
    Logs the choice once per process (:data:`LOGGER_NAME`).

    Raises:
      kda.KdaBackendError: the value is not one of :func:`setting_values` (the message names
        the setting, lists the valid values and shows the value given).
    """
    from kda import registry
    from kda.errors import KdaBackendError
    if isinstance(additional_config, dict):
        odd = sorted(k for k in additional_config if isinstance(k, str) and "kda" in k.lower()
                     and k not in (CONFIG_KEY,) + VLLM_KDA_KEYS)
        if odd:
            log_once(("keys", tuple(odd)), logging.WARNING,
                     "vLLM plugin: --additional-config has %s, which the plugin does not read "
                     "(its setting is %r; vLLM's own KDA keys: %s).", ", ".join(map(repr, odd)),
                     CONFIG_KEY, ", ".join(VLLM_KDA_KEYS))
    if isinstance(additional_config, dict) and additional_config.get(CONFIG_KEY) is not None:
        name, source = additional_config[CONFIG_KEY], f"--additional-config {CONFIG_KEY}"
        if isinstance(name, str):          # as $KDA_BACKEND: surrounding blanks do not count
            name = name.strip()
    elif os.environ.get(registry.ENV_VAR, "").strip():
        name, source = os.environ[registry.ENV_VAR].strip(), f"${registry.ENV_VAR}"
    else:
        name, source = "auto", "default"
    valid = setting_values()
    if not isinstance(name, str) or name not in valid:
        raise KdaBackendError(f"vLLM plugin: unknown value {name!r} for {source}: expected one "
                              f"of {', '.join(valid)} ({VLLM_PATH!r} keeps vLLM's own path)")
    version = vllm_version()
    if version is not None and version not in TESTED_VLLM_VERSIONS:
        tested = ", ".join(TESTED_VLLM_VERSIONS)
        if source == "default":
            name, source = VLLM_PATH, f"default under the untested vLLM {version}"
            log_once(("version", version), logging.WARNING,
                     "vLLM plugin: vLLM %s is not a version the KDA plugin was tested with "
                     "(%s): every KDA layer stays on vLLM's own path. To run kda.KdaDecode "
                     "anyway, give the setting: --additional-config '{\"%s\": \"auto\"}' "
                     "(or a backend name; or $%s).", version, tested, CONFIG_KEY,
                     registry.ENV_VAR)
        elif name != VLLM_PATH:
            log_once(("version", version), logging.WARNING,
                     "vLLM plugin: vLLM %s is not a version the KDA plugin was tested with "
                     "(%s); kda.KdaDecode runs because %s asks for %r.", version, tested,
                     source, name)
    if name == VLLM_PATH:
        log_once(("choice", name, source), logging.INFO,
                 "vLLM plugin: %s %r (from %s): every KDA layer runs vLLM's own path.",
                 CONFIG_KEY, name, source)
    else:
        log_once(("choice", name, source), logging.INFO,
                 "vLLM plugin: KDA fused decode backend %r (from %s). Pure-decode and uniform "
                 "speculative-verify batches of vLLM's Kimi-Linear, Kimi-K3 and GLM-5-Next KDA "
                 "layers run kda.KdaDecode; every other batch runs vLLM's own path.",
                 name, source)
    return name, source


def register() -> None:
    """The ``vllm.general_plugins`` entry point: replace vLLM's KDA layer classes (:data:`MODELS`).

    Kimi-Linear's class is registered at once; Kimi-K3's and GLM-5-Next's when vLLM imports
    their module (at once if it already has). Idempotent: a second call in a process (vLLM
    loads general plugins once per process, but tests and manual calls may repeat it) does
    nothing. When another plugin already registered a replacement for a class, that one is
    kept and a warning is logged. A model whose subclass cannot be built (its vLLM module
    fails to import) is left to vLLM, with a warning.
    """
    global _registered
    with _lock:
        if _registered:
            return
        _registered = True
        for model in MODELS.values():
            if model.deferred and model.vllm_module not in sys.modules:
                _hook().add(model)
            else:
                _register_model(model)


def layer_class(model: str = "Kimi-Linear"):
    """The subclass that replaces ``model``'s vLLM layer class (imports it, and vLLM's).

    Raises:
      KeyError: ``model`` is not one of :data:`MODELS` (the message lists them).
    """
    if model not in MODELS:
        raise KeyError(f"unknown model {model!r}; expected one of {', '.join(MODELS)}")
    spec = MODELS[model]
    return getattr(importlib.import_module(spec.module), spec.cls)


def __getattr__(name):
    # ``kda.integrations.vllm.KdaKimiGatedDeltaNetAttention`` etc.
    for model in MODELS.values():
        if name == model.cls:
            return layer_class(model.name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _skip_reason(model: Model) -> Optional[str]:
    if model.name != "Kimi-K3":
        return None
    from vllm.platforms import current_platform
    if current_platform.is_rocm() or current_platform.device_type == "tpu":
        return (f"on {current_platform.device_type} vLLM builds its own class named "
                f"{model.vllm_class}, not the NVIDIA one the plugin's subclass derives from")
    return None


def _register_model(model: Model) -> None:
    """Register ``model``'s subclass with vLLM (imports both); never raises."""
    try:
        why = _skip_reason(model)
        if why is not None:
            log_once(("skip", model.name), logging.INFO,
                     "vLLM plugin: %s's layer is not replaced: %s", model.name, why)
            return
        from vllm.model_executor.custom_op import op_registry_oot
        vllm_cls = getattr(importlib.import_module(model.vllm_module), model.vllm_class)
        cls = layer_class(model.name)
    except Exception as e:  # noqa: BLE001 - a plugin must not break vLLM's import of a model
        _log.warning("vLLM plugin: %s's layer stays vLLM's: %s: %s", model.name,
                     type(e).__name__, e)
        return
    with _lock:
        current = op_registry_oot.get(model.vllm_class)
        if current is None:
            vllm_cls.register_oot(cls)
        elif current is not cls:
            _log.warning("vLLM plugin: %s is already replaced by %s.%s; the KDA plugin leaves it",
                         model.vllm_class, current.__module__, current.__qualname__)
            return
    log_once(("registered", model.name), logging.INFO, "vLLM plugin: %s (%s) -> %s.%s",
             model.vllm_class, model.name, cls.__module__, cls.__qualname__)


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Registers a model's subclass right after the import system runs its vLLM module.

    Only the modules of :meth:`add` are touched: their spec comes from the finders after this
    one, with a loader that runs the module's own loader and then :func:`_register_model`.
    """

    def __init__(self):
        self._pending: Dict[str, Model] = {}

    def add(self, model: Model) -> None:
        self._pending[model.vllm_module] = model

    def pending(self) -> Tuple[str, ...]:
        """The module names still waited for."""
        return tuple(self._pending)

    def find_spec(self, fullname, path, target=None):
        model = self._pending.get(fullname)
        if model is None:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        del self._pending[fullname]
        spec.loader = _ThenRegister(spec.loader, model)
        return spec


class _ThenRegister(importlib.abc.Loader):
    """A module loader that, after the real one executed the module, registers ``model``."""

    def __init__(self, loader, model: Model):
        self._loader = loader
        self._model = model

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _register_model(self._model)

    def __getattr__(self, name):      # get_source, get_filename, is_package, ...
        return getattr(self._loader, name)


_finder: Optional[_RegisterOnImport] = None


def _hook() -> _RegisterOnImport:
    global _finder
    with _lock:
        if _finder is None:
            _finder = _RegisterOnImport()
            sys.meta_path.insert(0, _finder)
        return _finder
