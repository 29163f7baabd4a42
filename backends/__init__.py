"""Backends of the fused KDA decode step, one package each, loaded lazily by :mod:`kda.registry`."""
