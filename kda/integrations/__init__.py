"""Glue between :mod:`kda` and inference engines.

* :mod:`kda.integrations.vllm` -- the ``vllm.general_plugins`` entry point (``register``)
  that serves the decode and speculative-verify batches of vLLM's Kimi-Linear, Kimi-K3 and
  GLM-5-Next (GLM-5.3-Flash) KDA layers with :class:`kda.KdaDecode` (the layer classes: the
  private ``_vllm_*`` modules, which import vLLM); tested with vLLM 0.33.0 and 0.34.0.
* :mod:`kda.integrations.sglang` -- ``forward_decode``, a stand-in for SGLang 0.5.23's
  Kimi-Linear decode (conv, ``f_b`` projection, recurrence, ``o_norm``) that an engine
  engineer wires into ``KimiDeltaAttention.forward`` (SGLang has no hook at that level).

Nothing here is imported by ``import kda``; each module imports its engine lazily.
"""
