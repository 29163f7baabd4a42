"""Glue between :mod:`kda` and inference engines.

* :mod:`kda.integrations.vllm` -- the ``vllm.general_plugins`` entry point (``register``)
  that serves the decode and speculative-verify batches of vLLM's Kimi-Linear, Kimi-K3 and
  GLM-5-Next KDA layers with :class:`kda.KdaDecode` (the layer classes: the private
  ``_vllm_*`` modules, which import vLLM).

Nothing here is imported by ``import kda``; each module imports its engine lazily.
"""
