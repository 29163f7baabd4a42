"""The main job: serve a Kimi-Linear KDA layer step by step, as an inference server does.

Requests arrive and finish (continuous batching); each is prefilled with fla-core, then
decoded with the fused op of the selected backend (``--kda_backend``, ``$KDA_BACKEND``, or
auto) over a paged slot pool, in a batch padded with null slots to a bucket size; with
``--spec_tokens=T`` > 1 every step is a speculative verify of T tokens with a random accepted
count fed back as ``num_accepted_tokens``. Every generated token's layer output is checked
against fla-core run over the request's whole sequence; the maximum error is reported.

    tools/kda serve [flags]            # bazel run //tools/serve -- [flags]
    tools/kda serve --spec_tokens=3 --num_requests=32 --max_batch=16
    python3 -m tools.serve.serve --kda_backend=cutedsl --num_heads=16   # (GPU machine)

Progress: a live bar on a terminal; a plain line every few seconds when stdout is a file or
a log. Other packages' Python warnings show with ``-v 1`` only.

Parameters come from a safetensors file with the Hugging Face Kimi-Linear names
(``--checkpoint``); by default a seeded SYNTHETIC checkpoint of the real shapes is written once
to ``$KDA_CACHE_DIR/checkpoints/`` (default ``~/.cache/kda/checkpoints/``) and used.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import statistics
import sys
import time
from typing import Dict, List

import torch
from absl import app, flags, logging

import kda.flags  # noqa: F401  (defines --kda_backend)
from kda import registry
from kda.backend import cache_dir
from kda.config import KdaConfig
from kda.errors import KdaArgumentError
from kda.testing import TOLERANCES
from tools.serve import checkpoint as ckpt
from tools.serve.layer import KdaLayer
from tools import flags as _shared_flags  # noqa: F401  (defines --gate_mode)
from tools.flags import STATE_DTYPES, quiet_third_party_warnings, run, user_path

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", "", "safetensors file with HF Kimi-Linear parameter names, "
                    "any float dtype (cast: bf16 projections, fp32 conv, A_log, dt_bias, norm) "
                    "(default: a synthetic checkpoint of the real shapes, written once)")
flags.DEFINE_integer("layer", 0, "layer index in the checkpoint's parameter names")
flags.DEFINE_integer("num_heads", 32, "KDA heads on this GPU (Kimi-Linear: 32/16/8/4 at TP 1/2/4/8)")
flags.DEFINE_integer("tp_rank", 0, "tensor-parallel rank: serves heads [rank*H, (rank+1)*H)")
flags.DEFINE_float("lower_bound", None, "bounded gate lower bound in [-5, 0) (default: softplus gate)")
flags.DEFINE_enum("conv_layout", "SD", ["SD", "DS"], "conv cache layout")
flags.DEFINE_float("norm_eps", 1e-5, "gated RMSNorm eps")
flags.DEFINE_integer("spec_tokens", 1, "T: tokens per request per step (>1: speculative verify)")
flags.DEFINE_integer("num_requests", 12, "requests to serve")
flags.DEFINE_integer("max_batch", 8, "most requests decoded together")
flags.DEFINE_string("prompt_len", "8:48", "prompt length range lo:hi")
flags.DEFINE_string("gen_len", "8:24", "generated tokens per request, range lo:hi")
flags.DEFINE_float("arrival_rate", 0.7, "mean new requests per step")
flags.DEFINE_integer("seed", 0, "random seed")
flags.DEFINE_string("check_against", "", "also run every step with this backend on copies of the "
                    "caches and require agreement step for step (e.g. reference)")
flags.DEFINE_float("max_rel_err", 0.05, "fail when any token's layer output is further than "
                   "this (relative L2, per token) from fla-core over the whole sequence")
flags.DEFINE_enum("shadow_state_dtype", "", ["", "fp32", "bf16"], "also decode every step on a "
                  "shadow state pool of this dtype (with its own conv cache) and report, by decode "
                  "position, how far the outputs are from the shadow's and the shadow's from fla-core")
flags.DEFINE_string("error_json", "", "write the per-position error table (relative L2 error of "
                    "each generated token's layer output, by decode position) to this JSON file")

#: Decode positions (1-based, since the prompt) of the per-position error table.
POSITION_BINS = ((1, 16), (17, 64), (65, 256), (257, 1024), (1025, 4096), (4097, 16384),
                 (16385, 1 << 30))


def _range_ok(spec: str) -> bool:
    try:
        lo, hi = (int(v) for v in spec.split(":"))
    except ValueError:
        return False
    return 1 <= lo <= hi


for _name, _check, _msg in (
        ("max_batch", lambda v: v >= 1, "must be >= 1"),
        ("num_requests", lambda v: v >= 1, "must be >= 1"),
        ("spec_tokens", lambda v: v >= 1, "must be >= 1"),
        ("num_heads", lambda v: v >= 1, "must be >= 1"),
        ("tp_rank", lambda v: v >= 0, "must be >= 0"),
        ("layer", lambda v: v >= 0, "must be >= 0"),
        ("arrival_rate", lambda v: math.isfinite(v) and v >= 0, "must be finite and >= 0"),
        ("norm_eps", lambda v: math.isfinite(v) and v > 0, "must be finite and > 0"),
        ("max_rel_err", lambda v: math.isfinite(v) and v > 0, "must be finite and > 0"),
        ("lower_bound", lambda v: v is None or -5.0 <= v < 0.0, "must be in [-5, 0)"),
        ("prompt_len", _range_ok, "must be lo:hi with 1 <= lo <= hi"),
        ("gen_len", _range_ok, "must be lo:hi with 1 <= lo <= hi"),
        ("check_against", lambda v: v == "" or v in registry.CHOICES,
         "must be empty or one of " + ", ".join(registry.CHOICES))):
    flags.register_validator(_name, _check, message=f"--{_name} {_msg}")


@dataclasses.dataclass
class Request:
    rid: int
    arrival: int
    prompt_len: int
    gen_len: int
    gen: torch.Generator
    slots: List[int] = dataclasses.field(default_factory=list)
    hidden: List[torch.Tensor] = dataclasses.field(default_factory=list)   # accepted tokens
    outputs: List[torch.Tensor] = dataclasses.field(default_factory=list)  # decode outputs
    shadow: List[torch.Tensor] = dataclasses.field(default_factory=list)   # the shadow pool's
    accepted: int = 1
    generated: int = 0


def _range(spec: str):
    lo, hi = (int(v) for v in spec.split(":"))
    return lo, hi


def _bucket(n: int, cap: int) -> int:
    b = 1
    while b < n:
        b *= 2
    return min(max(b, 1), max(cap, n))


def _token_rel_err(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per token (row): ||got - ref|| / ||ref|| (fp32)."""
    return (got.float() - ref.float()).norm(dim=1) / ref.float().norm(dim=1).clamp_min(1e-30)


class PositionErrors:
    """Per-token relative errors collected by decode position (:data:`POSITION_BINS`), per
    comparison (e.g. "fla-core", "shadow", "shadow vs fla-core")."""

    def __init__(self):
        self.errs: Dict[str, List[List[float]]] = {}

    def add(self, what: str, err: torch.Tensor) -> None:
        """``err[i]``: the error of the token at decode position i + 1."""
        bins = self.errs.setdefault(what, [[] for _ in POSITION_BINS])
        for b, (lo, hi) in enumerate(POSITION_BINS):
            bins[b].extend(err[lo - 1:hi].tolist())

    def table(self) -> List[dict]:
        """One row per non-empty bin: {lo, hi, tokens, <what>: {median, p99, max}}."""
        rows = []
        for b, (lo, hi) in enumerate(POSITION_BINS):
            row = {"lo": lo, "hi": hi}
            for what, bins in self.errs.items():
                v = sorted(bins[b])
                if v:
                    row["tokens"] = len(v)
                    row[what] = {"median": statistics.median(v), "p99": v[int(0.99 * (len(v) - 1))],
                                 "max": v[-1]}
            if "tokens" in row:
                rows.append(row)
        return rows


class SlotPool:
    """Slot ids 1..size-1 (0 is the null slot) handed out in rows of T."""

    def __init__(self, size: int):
        self.free = list(range(size - 1, 0, -1))

    def take(self, n: int) -> List[int]:
        if len(self.free) < n:
            raise RuntimeError("slot pool exhausted")
        return [self.free.pop() for _ in range(n)]

    def give(self, ids: List[int]) -> None:
        self.free.extend(ids)


def default_checkpoint() -> str:
    """The seeded synthetic checkpoint, written once to ``$KDA_CACHE_DIR/checkpoints/`` (else
    ``~/.cache/kda/checkpoints/``)."""
    path = str(cache_dir("checkpoints") / "kimi_linear_kda_layer_SYNTHETIC_seed0.safetensors")
    if not os.path.exists(path):
        logging.info("writing the synthetic checkpoint %s", path)
        ckpt.write_synthetic(path, seed=0)
    return path


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _usage(msg: str):
    """A bad flag combination: one line on stderr, exit status 2 (no help dump)."""
    print(f"serve: error: {msg}", file=sys.stderr)
    sys.exit(2)


def main(argv):
    del argv
    from rich.table import Table

    from tools.progress import ToolProgress, tool_console

    console = tool_console()
    quiet_third_party_warnings(FLAGS.verbosity)
    if FLAGS.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    elif FLAGS.device == "cuda" and not torch.cuda.is_available():
        _usage("--device=cuda: torch sees no CUDA device here")
    else:
        device = torch.device(FLAGS.device)
    T, H = FLAGS.spec_tokens, FLAGS.num_heads
    if FLAGS.error_json:        # before the run: a bad path would lose its results
        where = os.path.dirname(os.path.abspath(user_path(FLAGS.error_json)))
        if not (os.path.isdir(where) and os.access(where, os.W_OK)):
            _usage(f"--error_json={FLAGS.error_json}: {where} is not a writable folder")
    path = user_path(FLAGS.checkpoint) or default_checkpoint()
    try:
        params, meta = ckpt.load_layer(path, FLAGS.layer)
    except KeyError as e:
        _usage(f"--layer {FLAGS.layer}: {e.args[0]}")
    except Exception as e:  # noqa: BLE001 - safetensors raises its own types for bad files
        _usage(f"--checkpoint {path} --layer {FLAGS.layer}: {type(e).__name__}: {e}")
    label = "SYNTHETIC" if "SYNTHETIC" in meta.get("content", "") else "checkpoint"
    if len(FLAGS.state_dtype) != 1:
        _usage(f"--state_dtype={','.join(FLAGS.state_dtype)}: the server takes one of fp32, bf16")
    cfg = KdaConfig(num_heads=H, T=T, window=T + 2, conv_layout=FLAGS.conv_layout,
                    lower_bound=FLAGS.lower_bound, gate_mode=FLAGS.gate_mode,
                    norm_eps=FLAGS.norm_eps, state_dtype=STATE_DTYPES[FLAGS.state_dtype[0]])
    total = params["A_log"].numel()
    if (FLAGS.tp_rank + 1) * H > total:
        _usage(f"--num_heads={H} --tp_rank={FLAGS.tp_rank}: heads "
               f"[{FLAGS.tp_rank * H}, {(FLAGS.tp_rank + 1) * H}) are outside the "
               f"checkpoint's {total} heads")
    slots = FLAGS.max_batch * T + 1          # the state pool: every active request's T slots
    shadow_dtype = STATE_DTYPES.get(FLAGS.shadow_state_dtype)       # None without a shadow
    pool_bytes = slots * H * 128 * 128 * sum(
        torch.empty((), dtype=d).element_size() for d in (cfg.state_dtype, shadow_dtype) if d)
    free = (torch.cuda.mem_get_info(device)[0] if device.type == "cuda"
            else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
    if pool_bytes > 0.8 * free:
        _usage(f"--max_batch={FLAGS.max_batch} --spec_tokens={T} --num_heads={H}: the state pool "
               f"needs {pool_bytes / 2**30:.1f} GiB, {free / 2**30:.1f} GiB are free on {device}")
    try:
        layer = KdaLayer(params, cfg, head0=FLAGS.tp_rank * H, device=device)
        check_op = kda.KdaDecode(cfg, device=device, backend=FLAGS.check_against) \
            if FLAGS.check_against else None
        shadow_op = kda.KdaDecode(dataclasses.replace(cfg, state_dtype=shadow_dtype),
                                  device=device) if shadow_dtype else None
    except (kda.KdaBackendError, KdaArgumentError) as e:
        _usage(str(e))
    requested, source = registry.requested_name()
    console.print(f"[bold]KDA layer[/] {label} parameters from {path}: hidden={layer.hidden}, "
                  f"heads [{FLAGS.tp_rank * H}, {(FLAGS.tp_rank + 1) * H}) of "
                  f"{params['A_log'].numel()}, {cfg.short()}")
    console.print(f"[bold]backend[/] {registry.describe(layer.op.backend)} (requested {requested} via {source}) "
                  f"on {device}" + (f"; every step also checked against {check_op.backend_name}"
                                    if check_op else ""))
    if shadow_op is not None:
        console.print(f"[bold]shadow[/] every step also decoded on a {FLAGS.shadow_state_dtype} state "
                      f"pool with {shadow_op.backend_name}")

    # ---- caches -------------------------------------------------------------------------
    dim = cfg.dim
    state = torch.zeros(slots, H, 128, 128, dtype=cfg.state_dtype, device=device)
    if cfg.conv_layout == "SD":
        conv_state = torch.zeros(slots, cfg.window, 3 * dim, dtype=torch.bfloat16,
                                 device=device).transpose(1, 2)
    else:
        conv_state = torch.zeros(slots, 3 * dim, cfg.window, dtype=torch.bfloat16, device=device)
    pool = SlotPool(slots)
    if shadow_op is not None:
        shadow_state = torch.zeros_like(state, dtype=shadow_op.cfg.state_dtype)
        shadow_conv = conv_state.clone()

    # ---- the request stream ---------------------------------------------------------------
    g = torch.Generator().manual_seed(FLAGS.seed)
    plo, phi = _range(FLAGS.prompt_len)
    glo, ghi = _range(FLAGS.gen_len)
    pending: List[Request] = []
    arrival = 0.0
    for rid in range(FLAGS.num_requests):
        pending.append(Request(rid, int(arrival), int(torch.randint(plo, phi + 1, (1,), generator=g)),
                               int(torch.randint(glo, ghi + 1, (1,), generator=g)),
                               torch.Generator().manual_seed(FLAGS.seed * 7919 + rid)))
        # Poisson arrivals at arrival_rate requests per step: exponential gaps of mean 1/rate
        # (torch's exponential_(lambd) has mean 1/lambd)
        arrival += float(torch.empty(1).exponential_(FLAGS.arrival_rate, generator=g)) \
            if FLAGS.arrival_rate > 0 else 0
    total_tokens = sum(r.gen_len for r in pending)

    def hidden(req: Request, n: int) -> torch.Tensor:
        return torch.randn(n, layer.hidden, generator=req.gen).to(torch.bfloat16).to(device)

    active: Dict[int, Request] = {}
    step_ms: List[float] = []
    steps_by_backend: collections.Counter = collections.Counter()
    accepted_tokens = 0
    max_err = {"abs": 0.0, "rel": 0.0, "token": 0.0}
    step_check_fail = []
    by_position = PositionErrors()
    padded_rows = 0
    step = 0
    t_start = time.perf_counter()
    with ToolProgress("decode", console) as bar:
        task = bar.add_task("decode", total=total_tokens)
        while pending or active:
            # admit arrivals: prefill with fla-core, place state and window in the slot row
            while pending and pending[0].arrival <= step and len(active) < FLAGS.max_batch:
                req = pending.pop(0)
                req.slots = pool.take(T)
                prompt = hidden(req, req.prompt_len)
                res = layer.sequence(prompt)
                s0 = req.slots[0]
                state[s0] = res.state.to(state.dtype)
                conv_state[s0, :, 0:3] = res.window.to(conv_state.dtype)
                if shadow_op is not None:
                    shadow_state[s0] = res.state.to(shadow_state.dtype)
                    shadow_conv[s0, :, 0:3] = res.window.to(shadow_conv.dtype)
                req.hidden.append(prompt)
                active[req.rid] = req
            if not active:
                step += 1
                continue
            reqs = list(active.values())
            R = len(reqs)
            Rp = _bucket(R, FLAGS.max_batch)
            padded_rows += (Rp - R) * T
            steps_by_backend[layer.op.backend_for(Rp)] += 1
            rows = [r.slots for r in reqs] + [[[0, -1][i % 2]] * T for i in range(Rp - R)]
            idx = torch.tensor(rows, dtype=torch.int32, device=device)
            state_indices = idx[:, 0].contiguous() if T == 1 else idx
            nacc = torch.tensor([r.accepted for r in reqs] + [1] * (Rp - R), dtype=torch.int32,
                                device=device) if T > 1 else None
            new_h = [hidden(r, T) for r in reqs]
            pad_h = torch.randn((Rp - R) * T, layer.hidden, generator=g).to(torch.bfloat16).to(device)
            h = torch.cat(new_h + [pad_h]) if Rp > R else torch.cat(new_h)
            if check_op is not None:
                st2, cs2 = state.clone(), conv_state.clone()
            _sync(device)
            t0 = time.perf_counter()
            y, o = layer.decode(h, conv_state, state, state_indices, nacc)
            _sync(device)
            t1 = time.perf_counter()
            step_ms.append((t1 - t0) * 1e3)
            if check_op is not None:
                y2, o2 = layer.decode(h, cs2, st2, state_indices, nacc, op=check_op)
                tol = TOLERANCES["out"]
                bad = ((o.float() - o2.float()).abs() > tol.loose_atol + tol.loose_rtol * o2.float().abs())
                frac = ((o.float() - o2.float()).abs() > tol.atol + tol.rtol * o2.float().abs()).float().mean()
                if bad.any() or frac > tol.frac or not torch.equal(cs2, conv_state):
                    step_check_fail.append(step)
            if shadow_op is not None:
                y_shadow, _ = layer.decode(h, shadow_conv, shadow_state, state_indices, nacc,
                                           op=shadow_op)
            if Rp > R and bool((o[R * T:] != 0).any()):
                raise AssertionError(f"step {step}: padded (null-slot) rows are not zero")
            # accept a random prefix of each request's T tokens
            done = []
            for i, req in enumerate(reqs):
                a = int(torch.randint(1, T + 1, (1,), generator=req.gen)) if T > 1 else 1
                a = min(a, req.gen_len - req.generated)
                req.hidden.append(new_h[i][:a])
                req.outputs.append(y[i * T:i * T + a])
                if shadow_op is not None:
                    req.shadow.append(y_shadow[i * T:i * T + a])
                req.accepted = a
                req.generated += a
                accepted_tokens += a
                bar.advance(task, a)
                if req.generated >= req.gen_len:
                    done.append(req)
            for req in done:
                seq = torch.cat(req.hidden)
                ref = layer.sequence(seq).layer_out[req.prompt_len:].float()
                got = torch.cat(req.outputs).float()
                err = (got - ref).abs().max().item()
                rel = ((got - ref).norm() / ref.norm()).item()
                max_err["abs"] = max(max_err["abs"], err)
                max_err["rel"] = max(max_err["rel"], rel)
                tokens = _token_rel_err(got, ref)
                max_err["token"] = max(max_err["token"], float(tokens.max()))
                by_position.add("fla-core", tokens)
                if shadow_op is not None:
                    sh = torch.cat(req.shadow)
                    by_position.add("shadow", _token_rel_err(got, sh))
                    by_position.add("shadow vs fla-core", _token_rel_err(sh, ref))
                pool.give(req.slots)
                del active[req.rid]
            bar.update(task, info=f"batch {R}/{Rp}  step {step_ms[-1]:.2f} ms")
            step += 1
    wall = time.perf_counter() - t_start

    tab = Table(title=f"KDA decode served with backend {layer.op.backend_name} on {device}")
    tab.add_column("metric")
    tab.add_column("value", justify="right")
    tab.add_row("requests / decode steps", f"{FLAGS.num_requests} / {len(step_ms)}")
    tab.add_row("tokens per step (T)", str(T))
    tab.add_row("accepted tokens", str(accepted_tokens))
    tab.add_row("padded (null-slot) rows, all zero", str(padded_rows))
    tab.add_row("decode steps per backend (auto: by batch size)",
                ", ".join(f"{b} {n}" for b, n in sorted(steps_by_backend.items())))
    tab.add_row("layer step latency median / p90 (ms)",
                f"{statistics.median(step_ms):.3f} / {sorted(step_ms)[int(0.9 * (len(step_ms) - 1))]:.3f}")
    tab.add_row("accepted tokens / s (layer steps)", f"{accepted_tokens / (sum(step_ms) / 1e3):.1f}")
    tab.add_row("wall time incl. prefill and checks (s)", f"{wall:.2f}")
    tab.add_row("max |error| vs fla-core whole sequence", f"{max_err['abs']:.4g}")
    tab.add_row("max relative L2 error per request", f"{max_err['rel']:.4g}")
    tab.add_row("max relative L2 error per token (--max_rel_err)", f"{max_err['token']:.4g}")
    if check_op is not None:
        tab.add_row(f"steps disagreeing with {check_op.backend_name}", str(len(step_check_fail)))
    console.print(tab)
    rows = by_position.table()
    pos = Table(title="relative L2 error of a token's layer output by decode position "
                      "(median / p99 / max over tokens)")
    pos.add_column("positions")
    pos.add_column("tokens", justify="right")
    whats = list(by_position.errs)
    names = {"fla-core": f"{FLAGS.state_dtype[0]} state vs fla-core",
             "shadow": f"{FLAGS.state_dtype[0]} state vs {FLAGS.shadow_state_dtype} shadow",
             "shadow vs fla-core": f"{FLAGS.shadow_state_dtype} shadow vs fla-core"}
    for what in whats:
        pos.add_column(names[what], justify="right")
    for row in rows:
        pos.add_row(f"{row['lo']}-{row['hi']}", str(row["tokens"]),
                    *(" / ".join(f"{row[w][k]:.3g}" for k in ("median", "p99", "max")) for w in whats))
    console.print(pos)
    if FLAGS.error_json:
        import json
        with open(user_path(FLAGS.error_json), "w") as f:
            json.dump({"config": cfg.short(), "state_dtype": FLAGS.state_dtype[0],
                       "shadow_state_dtype": FLAGS.shadow_state_dtype or None,
                       "backend": layer.op.backend_name,
                       "shadow_backend": shadow_op.backend_name if shadow_op else None,
                       "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                       else "cpu", "requests": FLAGS.num_requests, "decode_steps": len(step_ms),
                       "comparisons": {w: names[w] for w in whats}, "by_position": rows}, f, indent=1)
    ok = max_err["token"] <= FLAGS.max_rel_err and not step_check_fail
    console.print("[bold green]CHECK PASSED[/]" if ok else "[bold red]CHECK FAILED[/]",
                  f"(every generated token vs fla-core over the whole sequence; limit rel {FLAGS.max_rel_err})")
    return 0 if ok else 1


if __name__ == "__main__":
    run(main)
