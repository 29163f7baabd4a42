"""``python3 -m kda``: which backends run here, and why the others do not; which schedule
table ``cutedsl`` uses on this GPU."""

from rich.console import Console
from rich.table import Table

from kda.registry import status


def main() -> None:
    table = Table(title="KDA decode backends")
    for col in ("backend", "runs here", "what it is, or why it cannot run"):
        table.add_column(col)
    for name, why, description in status():
        table.add_row(name, "yes" if why is None else "[red]no[/red]",
                      description if why is None else why)
    console = Console()
    console.print(table)
    console.print(_schedules())


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


if __name__ == "__main__":
    main()
