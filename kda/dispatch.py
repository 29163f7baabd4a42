"""From a call's arguments to the step function that runs it: derive the configuration,
validate every tensor, allocate ``out`` if needed, resolve the backend (cached per choice
and configuration). Shared by the public entry points (:mod:`kda.op`) and the custom op
(:mod:`kda.torch_op`)."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from kda import registry
from kda.backend import StepFn
from kda.config import KdaArgs, KdaConfig
from kda.errors import KdaArgumentError
from kda.validate import check_x_is_2d, config_from_args, validate_args, write_mode

_resolved: Dict[tuple, StepFn] = {}


def resolved_step(cfg: KdaConfig, device: torch.device, explicit: Optional[str]) -> StepFn:
    """The step function for this call's backend choice, resolved once per choice and config.

    Raises:
      KdaBackendError: as :func:`kda.registry.resolve`.
    """
    key = (registry.requested_name(explicit), cfg, str(device))
    fn = _resolved.get(key)
    if fn is None:
        fn = registry.step_fn(registry.resolve(cfg, device, explicit), cfg, device)
        _resolved[key] = fn
    return fn


def alloc_out(x: torch.Tensor, dim: int) -> torch.Tensor:
    """A new bf16 ``out`` [N, dim] on ``x``'s device (``x`` checked to be 2-D first)."""
    check_x_is_2d(x)
    return torch.empty(x.shape[0], dim, dtype=torch.bfloat16, device=x.device)


def validated_step(args: KdaArgs, *, scale, norm_eps, lower_bound, gate_mode,
                   beta_activated=False, early_reads=False,
                   backend: Optional[str]) -> Tuple[StepFn, KdaArgs]:
    """Everything :func:`kda.kda_decode` does before launching.

    Returns:
      (step, args): ``args`` with ``out`` allocated if it was None; ``step(args)`` runs the
      step (skip it when R == 0).

    Raises:
      KdaArgumentError, KdaBackendError: as :func:`kda.kda_decode`; nothing has been written.
    """
    if (args.v_record is None) != (args.kg_record is None):
        missing = "kg_record" if args.kg_record is None else "v_record"
        raise KdaArgumentError(missing, "record mode needs both v_record and kg_record, got only one")
    cfg = config_from_args(args, scale=scale, norm_eps=norm_eps, lower_bound=lower_bound,
                           gate_mode=gate_mode, beta_activated=beta_activated,
                           early_reads=early_reads)
    if args.out is None and isinstance(args.x, torch.Tensor):
        args = args._replace(out=alloc_out(args.x, cfg.dim))
    validate_args(cfg, args)
    return resolved_step(cfg, args.x.device, backend), args


def metadata_key(args: KdaArgs) -> tuple:
    """dtype, shape, strides and device of every argument (None for absent optional ones;
    a non-tensor gives a value equal to nothing, so it is never taken as validated), and
    :func:`kda.validate.write_mode`."""
    return tuple(None if t is None else
                 (t.dtype, t.shape, t.stride(), t.device) if isinstance(t, torch.Tensor) else
                 (object(),)
                 for t in args) + (write_mode(args),)
