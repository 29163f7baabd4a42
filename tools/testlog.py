"""``tools/kda test`` when its output is a log (a file, a pipe, CI): Bazel's test run with the
tools' progress line every few seconds.

Without a terminal Bazel 4 prints a progress line only after 15% more of the run has passed
since the last one (lines more than a minute apart late in a 10-minute run), and prints its
final "Build completed" line twice. Here Bazel runs with ``--noshow_progress`` (its messages,
warnings, errors and test summary still show) and writes its Build Event Protocol to a file;
the test targets configured and the test summaries in it drive a
:class:`tools.progress.ToolProgress`, whose plain line comes every :data:`tools.progress.LOG_EVERY`
seconds: test targets done / configured, the failed ones, the last one done, the elapsed time.

    python3 -m tools.testlog bazel test [bazel flags and targets]   # as tools/kda test does

Exit status: Bazel's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional

from tools.progress import LOG_EVERY, ToolProgress, tool_console

#: Seconds between two reads of the event file.
POLL = 0.2


class Tests:
    """What a Build Event Protocol stream (JSON, one event a line) has said so far about the
    test targets: those configured, and the overall status of those done."""

    def __init__(self):
        self.configured: List[str] = []
        self.status: Dict[str, str] = {}
        self.last = ""

    def add(self, event: dict) -> None:
        eid = event.get("id", {})
        if "targetConfigured" in eid and "testSize" in event.get("configured", {}):
            self.configured.append(eid["targetConfigured"]["label"])
        elif "testSummary" in eid:
            label = eid["testSummary"]["label"]
            self.status[label] = event.get("testSummary", {}).get("overallStatus", "NO_STATUS")
            self.last = label

    def info(self) -> str:
        """The progress line's text: the failed test targets, then the last one done."""
        failed = [label for label, s in self.status.items() if s != "PASSED"]
        parts = [f"{len(failed)} not passed: {', '.join(failed)}"] if failed else []
        if self.last:
            parts.append(f"last {self.last} {self.status[self.last]}")
        return "; ".join(parts)


class EventFile:
    """Reads the complete lines a writer has appended to ``path`` since the last read (the
    file may not exist yet)."""

    def __init__(self, path: str):
        self.path = path
        self.offset = 0
        self.partial = b""

    def events(self) -> List[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        return [json.loads(line) for line in lines if line.strip()]


def run(bazel: List[str], every: float = LOG_EVERY, console=None) -> int:
    """Runs ``bazel`` (``[bazel, test, args...]``) with ``--noshow_progress`` and an event file,
    showing its progress on ``console`` (default: the tools' console on stderr, where Bazel
    prints its own messages) every ``every`` seconds; returns Bazel's exit status."""
    console = console or tool_console(stderr=True)
    with tempfile.TemporaryDirectory(prefix="kda-testlog-") as tmp:
        path = os.path.join(tmp, "events.json")
        cmd = bazel[:2] + ["--noshow_progress", f"--build_event_json_file={path}"] + bazel[2:]
        tests, events = Tests(), EventFile(path)
        proc = subprocess.Popen(cmd)
        with ToolProgress("tests", console, every=every) as bar:
            task = bar.add_task("tests", total=None)

            def update() -> None:
                for event in events.events():
                    tests.add(event)
                bar.update(task, total=len(tests.configured) or None,
                           completed=len(tests.status), info=tests.info())

            code: Optional[int] = None
            while code is None:
                try:
                    code = proc.wait(POLL)
                except subprocess.TimeoutExpired:
                    pass
                except KeyboardInterrupt:      # Bazel got it too: wait for it to stop
                    code = proc.wait()
                update()
    return code


def main(argv: List[str]) -> int:
    if len(argv) < 3:
        print("usage: python3 -m tools.testlog bazel test [flags and targets]", file=sys.stderr)
        return 2
    return run(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
