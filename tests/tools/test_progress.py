"""tools/progress.py: in a log (not an interactive terminal) a plain progress line every few
seconds, made of rich's columns, and none of the live bar's control codes."""

import io
import time

from rich.console import Console

from tools.progress import ToolProgress


def test_plain_lines_every_interval_when_not_a_terminal():
    out = io.StringIO()
    console = Console(file=out, width=100)
    assert not console.is_interactive
    with ToolProgress("decode", console, every=0.05) as bar:
        task = bar.add_task("decode", total=3)
        for i in range(3):
            time.sleep(0.25)
            bar.update(task, advance=1, info=f"step {i}")
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    assert len(lines) >= 4, lines                   # several while running, one at the end
    assert all(line.startswith("decode ") for line in lines), lines
    assert any(" 1/3 " in line for line in lines) and " 3/3 " in lines[-1], lines
    assert "step 2" in lines[-1]
    text = out.getvalue()
    assert "\x1b" not in text and "\r" not in text and "━" not in text    # no live bar


def test_a_terminal_gets_rich_s_live_bar_and_no_plain_lines():
    out = io.StringIO()
    console = Console(file=out, width=100, force_terminal=True, force_interactive=True)
    with ToolProgress("cells", console, every=0.05) as bar:
        task = bar.add_task("cells", total=2)
        time.sleep(0.3)
        bar.update(task, advance=2)
    assert bar._lines is None
    assert "━" in out.getvalue()                    # the bar column


def test_tool_console_never_breaks_a_line_and_tables_still_fit():
    """In a log (rich takes 80 columns) a verdict longer than the width stays one line, so a
    grep of the log finds all of it; a table is still drawn within the width."""
    from rich.table import Table

    from tools.progress import tool_console

    out = io.StringIO()
    console = tool_console(file=out, width=80)
    verdict = ("CHECK PASSED (every generated token vs fla-core over the whole sequence; "
               "limit rel 0.05)")
    assert len(verdict) > 80
    console.print("[bold green]CHECK PASSED[/]", verdict[len("CHECK PASSED "):])
    table = Table("metric", "value")
    table.add_row("a metric with a long name " * 3, "1")
    console.print(table)
    lines = out.getvalue().splitlines()
    assert lines[0] == verdict
    assert max(len(line) for line in lines[1:]) <= 80
