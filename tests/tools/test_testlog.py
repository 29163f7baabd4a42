"""tools/testlog.py, ``tools/kda test`` in a log, with a stand-in for Bazel that writes its
Build Event Protocol file slowly: a progress line comes every interval while Bazel is silent,
counting the test targets configured and done and naming the failed ones; Bazel runs without
its own progress (whose lines grow apart in a log, and whose last line came twice); its exit
status is the run's."""

import io
import json
import pathlib
import sys
import textwrap

from rich.console import Console

from tools import testlog

FAKE_BAZEL = textwrap.dedent('''\
    import json, sys, time
    args = sys.argv[1:]
    open(sys.argv[0] + ".args", "w").write(json.dumps(args))
    path = next(a.split("=", 1)[1] for a in args if a.startswith("--build_event_json_file="))

    def emit(event):
        with open(path, "a") as f:
            f.write(json.dumps(event) + "\\n")

    emit({"id": {"started": {}}, "started": {}})
    emit({"id": {"targetConfigured": {"label": "//a:lib"}},
          "configured": {"targetKind": "py_library rule"}})
    for label in ("//a:t1", "//a:t2"):
        emit({"id": {"targetConfigured": {"label": label}},
              "configured": {"targetKind": "py_test rule", "testSize": "SMALL"}})
    time.sleep(0.6)
    emit({"id": {"testSummary": {"label": "//a:t1"}}, "testSummary": {"overallStatus": "PASSED"}})
    time.sleep(0.6)
    with open(path, "a") as f:                 # a line written in two parts
        f.write('{"id": {"testSummary": {"label": "//a:t2"}}, ')
        f.flush()
        time.sleep(0.3)
        f.write('"testSummary": {"overallStatus": "FAILED"}}\\n')
    sys.exit(3)
    ''')


def test_progress_lines_from_the_event_file_while_bazel_is_silent(tmp_path):
    fake = tmp_path / "bazel"
    fake.write_text(f"#!{sys.executable}\n" + FAKE_BAZEL)
    fake.chmod(0o755)
    out = io.StringIO()
    code = testlog.run([str(fake), "test", "--test_output=errors", "//..."],
                       every=0.1, console=Console(file=out, width=120))
    assert code == 3
    args = json.loads(pathlib.Path(str(fake) + ".args").read_text())
    assert args[:2] == ["test", "--noshow_progress"]
    assert args[2].startswith("--build_event_json_file=") and args[3:] == ["--test_output=errors",
                                                                           "//..."]
    lines = [line.strip() for line in out.getvalue().splitlines() if line.strip()]
    assert all(line.startswith("tests ") for line in lines), lines
    # several lines in each silent stretch of 0.6 s (one every 0.1 s), none only at the end
    assert sum(" 0/2 " in line for line in lines) >= 2, lines
    assert sum(" 1/2 last //a:t1 PASSED " in line for line in lines) >= 2, lines
    assert " 2/2 1 not passed: //a:t2; last //a:t2 FAILED " in lines[-1], lines


def test_events_are_read_as_they_are_appended(tmp_path):
    """Only complete lines are read; the rest waits for its newline; a missing file is empty."""
    path = tmp_path / "events.json"
    events = testlog.EventFile(str(path))
    assert events.events() == []
    path.write_text('{"a": 1}\n{"b"')
    assert events.events() == [{"a": 1}]
    with open(path, "a") as f:
        f.write(': 2}\n')
    assert events.events() == [{"b": 2}] and events.events() == []
