"""Glue between :mod:`kda` and inference engines.

* :mod:`kda.integrations.vllm` -- the ``vllm.general_plugins`` entry point (``register``)
  that serves vLLM's Kimi-Linear KDA layer's decode and speculative-verify batches with
  :class:`kda.KdaDecode`.

Nothing here is imported by ``import kda``; each module imports its engine lazily.
"""
