"""pytest options shared by every test of the project.

--kda-backends=a,b       only these backends (default: every registered backend)
--kda-require-backends   a backend that cannot run here FAILS instead of being skipped
                         (use on the GPU machine, where every backend must run)
--kda-matrix=ci|full     the conformance matrix: small shapes (CI, CPU) or the full one (GPU)
--kda-device=cpu|cuda    device for the cases (default: cuda when available, else cpu)
--kda-shard=i/n          only every n-th test, starting at test i (parallel runs; a Bazel
                         target's shard_count sets it, tests/pytest_main.py)
--kda-state-dtypes=a,b   the state pool dtypes the conformance cases run with (fp32, bf16;
                         default both)
"""

import pytest
import torch


def pytest_addoption(parser):
    g = parser.getgroup("kda")
    g.addoption("--kda-backends", default="", help="comma-separated backend names to test")
    g.addoption("--kda-require-backends", action="store_true",
                help="fail (instead of skip) when a selected backend cannot run here")
    g.addoption("--kda-matrix", default="ci", choices=("ci", "full"),
                help="conformance matrix size")
    g.addoption("--kda-device", default=None, choices=("cpu", "cuda"), help="device for the cases")
    g.addoption("--kda-shard", default="0/1", help="i/n: only tests i, i+n, i+2n, ... (each "
                "backend's tests dealt out evenly)")
    g.addoption("--kda-state-dtypes", default="fp32,bf16",
                help="comma-separated state pool dtypes of the conformance cases (fp32, bf16)")


def shard_of(config):
    """(i, n) from ``--kda-shard=i/n``; a malformed value is a usage error."""
    raw = config.getoption("--kda-shard")
    try:
        i, n = (int(v) for v in raw.split("/"))
        if not 0 <= i < n:
            raise ValueError
    except ValueError:
        raise pytest.UsageError(f"--kda-shard expects i/n with 0 <= i < n, got {raw!r}") from None
    return i, n


def state_dtypes_of(config):
    """The names from ``--kda-state-dtypes``; an unknown or empty one is a usage error."""
    names = [d for d in config.getoption("--kda-state-dtypes").split(",") if d]
    if not names or any(d not in ("fp32", "bf16") for d in names):
        raise pytest.UsageError("--kda-state-dtypes expects names from fp32, bf16, got "
                                f"{config.getoption('--kda-state-dtypes')!r}")
    return tuple(names)


def pytest_collection_modifyitems(config, items):
    """``--kda-shard=i/n``: keep every n-th test from test i. The tests are dealt out in order
    of backend (``backend_name``) and test function, so that each shard gets its share of
    every backend's and every function's tests (the Triton interpreter's are the slow ones).
    Tests without a backend that share a parametrization (the CuTe DSL compile tests' kernel
    configurations, compiled once for several checks) are dealt out together."""
    i, n = shard_of(config)
    if n == 1:
        return
    groups = {}
    for item in items:
        spec = getattr(item, "callspec", None)
        shared = spec is not None and "backend_name" not in spec.params
        groups.setdefault(("id", spec.id) if shared else ("test", item.nodeid), []).append(item)

    def order(key):
        first = groups[key][0]
        spec = getattr(first, "callspec", None)
        backend = str(spec.params.get("backend_name", "")) if spec is not None else ""
        return backend, getattr(first, "originalname", first.name)

    keep = {id(item) for key in sorted(groups, key=order)[i::n] for item in groups[key]}
    config.hook.pytest_deselected(items=[item for item in items if id(item) not in keep])
    items[:] = [item for item in items if id(item) in keep]


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device")
    config.addinivalue_line("markers", "bigmem: GPU-scale memory (8+ GiB); run alone on the GPU")


@pytest.fixture(scope="session")
def kda_device(pytestconfig) -> torch.device:
    d = pytestconfig.getoption("--kda-device")
    if d is None:
        d = "cuda" if torch.cuda.is_available() else "cpu"
    if d == "cuda" and not torch.cuda.is_available():
        pytest.fail("--kda-device=cuda but no CUDA device is available")
    return torch.device(d)


@pytest.fixture(scope="session")
def kda_matrix(pytestconfig) -> str:
    return pytestconfig.getoption("--kda-matrix")


def selected_backends(config):
    from kda.registry import BACKEND_NAMES
    want = [b for b in config.getoption("--kda-backends").split(",") if b]
    unknown = [b for b in want if b not in BACKEND_NAMES]
    if unknown:
        raise pytest.UsageError(f"--kda-backends: unknown {unknown}; valid: {BACKEND_NAMES}")
    return want or list(BACKEND_NAMES)


def pytest_generate_tests(metafunc):
    if "backend_name" in metafunc.fixturenames:
        metafunc.parametrize("backend_name", selected_backends(metafunc.config))


def _skip_or_fail(config, msg):
    if config.getoption("--kda-require-backends"):
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture
def require_backend(pytestconfig):
    """require_backend(name, cfg, device) -> Backend, or skip (fail with --kda-require-backends)."""
    from kda.registry import get_backend, unsupported_reasons

    def check(name, cfg, device):
        why = unsupported_reasons(name, cfg, device)
        if why:
            _skip_or_fail(pytestconfig, f"backend {name} cannot run {cfg.short()} on {device}: "
                                        f"{'; '.join(why)}")
        return get_backend(name)

    return check


@pytest.fixture
def require_available(pytestconfig):
    """require_available(name): skip (fail with --kda-require-backends) unless it can run here."""
    from kda.registry import availability

    def check(name):
        why = availability(name)
        if why is not None:
            _skip_or_fail(pytestconfig, f"{name} backend unavailable: {why}")

    return check
