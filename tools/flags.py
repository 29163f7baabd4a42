"""absl flags that more than one tool defines, defined once here.

absl's flag registry is process-wide: two tool modules that each defined ``--gate_mode``
could not be imported into one process (``python3 -m pytest tests`` imports both the bench's
and the server's tests). Tools import the shared flags from here instead.
"""

import os

import torch
from absl import flags

GATE_MODE = flags.DEFINE_integer(
    "gate_mode", 0, "gate projection accumulation order: 0 = one chain over the rank, "
    "1 = four 32-wide chains summed ((c0+c1)+c2)+c3 (docs/contract.md)")
flags.register_validator("gate_mode", lambda v: v in (0, 1), message="--gate_mode must be 0 or 1")

#: --state_dtype names.
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
STATE_DTYPE = flags.DEFINE_list(
    "state_dtype", ["fp32"], "state pool dtype: fp32 or bf16 (half the bytes, fp32 math, each "
    "state written rounded once); tools/serve takes one, tools/bench a list (a dimension of its "
    "grid: the floor counts 32 KiB bf16 pages; peers other than touch run fp32 only)")
flags.register_validator("state_dtype", lambda v: len(v) > 0 and all(d in STATE_DTYPES for d in v),
                         message="--state_dtype takes fp32, bf16 (a list for tools/bench)")

DEVICE = flags.DEFINE_enum("device", "auto", ["auto", "cpu", "cuda"],
                           "where to run (auto: cuda when available, else cpu)")


def user_path(path: str) -> str:
    """A path flag as the user meant it: relative to the directory the command was started
    in. ``tools/kda`` changes to the repository root and names that directory in
    ``KDA_USER_DIR``; ``bazel run`` starts a tool in its runfiles tree and names the directory
    it was started in ``BUILD_WORKING_DIRECTORY``; without either (``python3 -m``) the path is
    left as given. Absolute and empty paths are returned unchanged."""
    base = os.environ.get("KDA_USER_DIR") or os.environ.get("BUILD_WORKING_DIRECTORY", "")
    if not path or os.path.isabs(path) or not base:
        return path
    return os.path.join(base, path)
