"""``python3 -m kda``: which backends run here, and why the others do not."""

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
    Console().print(table)


if __name__ == "__main__":
    main()
