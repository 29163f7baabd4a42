"""absl flags that more than one tool defines, defined once here.

absl's flag registry is process-wide: two tool modules that each defined ``--gate_mode``
could not be imported into one process (``python3 -m pytest tests`` imports both the bench's
and the server's tests). Tools import the shared flags from here instead.
"""

import os
import sys
import warnings

import torch
from absl import app, flags

GATE_MODE = flags.DEFINE_integer(
    "gate_mode", 0, "gate projection accumulation order: 0 = one chain over the rank, "
    "1 = four 32-wide chains summed ((c0+c1)+c2)+c3 (docs/contract.md)")
flags.register_validator("gate_mode", lambda v: v in (0, 1), message="--gate_mode must be 0 or 1")

#: --state_dtype names.
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
STATE_DTYPE = flags.DEFINE_list(
    "state_dtype", ["fp32"], "state pool dtype: fp32 or bf16 (half the bytes, fp32 math, each "
    "state written rounded once); tools/serve takes one value, tools/bench and tools/kda tune "
    "a list (a dimension of the grid: the floor counts 32 KiB bf16 pages; peers other than "
    "touch run fp32 only; the tuner's default is both)")
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


#: The arguments that ask for the usage (absl's --help, --helpshort and -?, and -h).
HELP_ARGS = ("--help", "--helpshort", "-?", "-h", "--helpfull")


def usage_text(full: bool = False) -> str:
    """The tool's usage: the main module's docstring, then the flags of the main module and
    of the project's modules (:mod:`kda.flags`, this one), or with ``full`` every flag. absl
    heads the main module's flags with its file, under ``bazel run`` a long runfiles path:
    here the tool's own flags come first, headed "flags:" alone."""
    doc = (sys.modules["__main__"].__doc__ or "").strip()
    if full:
        return f"{doc}\n\n{flags.FLAGS.get_help()}\n"
    main = sys.argv[0]
    parts = []
    for module in flags.FLAGS.flags_by_module_dict():
        if module == main or module.split(".")[0] in ("kda", "tools"):
            lines = flags.FLAGS.module_help(module).strip("\n").split("\n")
            parts.append("\n".join(lines[1:]) if module == main else "\n".join(lines))
    main_first = sorted(parts, key=lambda p: not p.startswith("  "))
    return f"{doc}\n\nflags:\n" + "\n\n".join(main_first) + \
        "\n\n(--helpfull: every flag, absl's own among them)\n"


def parse_flags(argv):
    """absl's flag parsing, except that a help argument (:data:`HELP_ARGS`, before any
    ``--``) prints :func:`usage_text` on stdout and exits with status 0 (absl's own exits 1)."""
    args = argv[1:argv.index("--")] if "--" in argv else argv[1:]
    asked = [a for a in args if a in HELP_ARGS]
    if asked:
        sys.stdout.write(usage_text(full="--helpfull" in asked))
        sys.exit(0)
    return app.parse_flags_with_usage(argv)


def run(main) -> None:
    """``absl.app.run(main)`` with :func:`parse_flags`: what every tool's ``__main__`` calls."""
    app.run(main, flags_parser=parse_flags)


#: The modules whose warnings a tool shows without being asked (the project's own).
OWN_MODULES = r"(kda|tools|__main__)(\.|$)"


def quiet_third_party_warnings(verbosity: int) -> None:
    """Below absl's ``--verbosity=1`` (``-v 1``), Python warnings raised by other packages'
    modules (fla-core's "Triton is not supported on current platform, roll back to CPU" on
    every CPU run, among them) are not shown; the project's own still are."""
    if verbosity >= 1:
        return
    warnings.filterwarnings("ignore")
    warnings.filterwarnings("default", module=OWN_MODULES)
