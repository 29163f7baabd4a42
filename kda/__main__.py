"""``python3 -m kda``: which backends run here, and why the others do not; which schedule
table ``cutedsl`` uses on this GPU; without a GPU (an image being built), what ``auto`` would
take first on one and whether CuTe DSL imports here."""

from rich.console import Console
from rich.table import Table

from kda import registry
from kda.errors import KdaBackendError
from kda.registry import status


def main(argv=None) -> int:
    """The report; exit status 0, or 2 for any argument (it takes none; --help prints this
    module's docstring)."""
    import sys
    args = sys.argv[1:] if argv is None else argv
    if args:
        print(__doc__.strip())
        if args in (["--help"], ["-h"]):
            return 0
        print(f"python3 -m kda: takes no arguments, got {' '.join(args)}", file=sys.stderr)
        return 2
    table = Table(title="KDA decode backends")
    for col in ("backend", "runs here", "what it is, or why it cannot run"):
        table.add_column(col)
    for name, why, description in status():
        table.add_row(name, "yes" if why is None else "[red]no[/red]",
                      description if why is None else why)
    console = Console()
    console.print(table)
    console.print(_schedules())
    note = _without_gpu()
    if note:
        console.print(note)
    try:                                   # what a step would refuse: say it here too
        registry.check_choice(*registry.requested_name())
    except KdaBackendError as e:
        console.print(f"[red]{e}[/red]")
    return 0


def _schedules() -> str:
    """Which schedule table ``cutedsl`` uses here (:func:`kda.backends.cutedsl.tables.describe`)."""
    import torch

    from kda.backends.cutedsl import tables

    gpu = torch.cuda.is_available()
    name = torch.cuda.get_device_name() if gpu else None
    sms = (torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
           if gpu else None)
    try:
        return tables.describe(name, sms)
    except ValueError as e:         # a broken table file: say so rather than fail the report
        return f"cutedsl schedules: {e}"


def _without_gpu() -> str:
    """Without a CUDA GPU: ``auto``'s first choice on one at H=32, T=1 and 4, every measured
    batch size (:func:`kda.auto.plan`; it takes the first of its order that runs there), and
    whether CuTe DSL imports here (which release). Empty with a GPU (the table says it)."""
    import torch

    if torch.cuda.is_available():
        return ""
    from kda import auto
    from kda.backends.cutedsl.backend import import_cutedsl, installed_release, version_note
    from kda.config import KdaConfig

    firsts = {T: sorted({order[0] for order in auto.plan(KdaConfig(num_heads=32, T=T),
                                                            torch.device("cuda")).values()})
              for T in (1, 4)}
    lines = ["on a CUDA GPU, auto's first choice (H=32, every measured batch size): "
             + "; ".join(f"T={T} {', '.join(n)}" for T, n in firsts.items())
             + " (it runs the first of its order that runs there)"]
    why = import_cutedsl()
    if why is None:
        release = installed_release()
        note = version_note(release)
        lines.append(f"CuTe DSL imports here (nvidia-cutlass-dsl {release or 'of unknown release'}"
                     "): cutedsl would run on a GPU of compute capability 9.0 or higher"
                     + (f"; {note}" if note else ""))
    else:
        lines.append(f"CuTe DSL does not import here: {why}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
