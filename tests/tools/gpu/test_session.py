"""tools/gpu/session.sh's sanitize stage, run on the CPU with a stand-in compute-sanitizer:
a racecheck run that ends with the program gone and no hazard reported runs once more alone,
one with a hazard or a failed check does not, and every result stays in the summary."""

import os
import shutil
import subprocess
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# The stand-in: racecheck of the named steps fails as seen on the GPU machine (program gone,
# no hazard) the first time (gone), every time with a hazard (hazard) or with a failed check
# (wrong); every other run is clean. Each call is logged.
FAKE = textwrap.dedent("""\
    #!/bin/bash
    tool=$2; shift 8; shift 3          # --tool T --print-limit 20 --error-exitcode 9 --report-api-errors no python3 -m mod
    echo "$tool $*" >> "$CALLS"
    key="$tool $*"
    clean() { echo "$1"; echo "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"; exit 0; }
    if [ "$tool" = racecheck ]; then
      case "$*" in
        "cutedsl:stream 8 100 2 fp32")
          if [ ! -e "$CALLS.gone" ]; then touch "$CALLS.gone"
            echo "========= Error: process didn't terminate successfully"
            echo "========= Target application returned an error"
            echo "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"; exit 9; fi
          clean "cutedsl:stream H8 R=100: ok" ;;
        "cutedsl:stream4t 8 100 2 bf16")
          echo "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)"; exit 9 ;;
        "cutedsl_wide 4 3 1 fp32")
          echo "cutedsl_wide H4 R=3: out differs"
          echo "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"; exit 9 ;;
      esac
    fi
    clean "step: ok"
    """)


def test_sanitize_retries_only_a_vanished_racecheck_alone(tmp_path):
    tree = tmp_path / "tree"
    (tree / "tools" / "gpu").mkdir(parents=True)
    for f in ("session.sh", "tree_digest.sh"):
        shutil.copy(os.path.join(ROOT, "tools", "gpu", f), tree / "tools" / "gpu" / f)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "compute-sanitizer").write_text(FAKE)
    # no python on this PATH: the session's environment lines fail and are logged, as on a
    # machine without torch
    (bin_ / "python3").write_text("#!/bin/sh\nexit 1\n")
    for f in bin_.iterdir():
        f.chmod(0o755)
    out, calls = tmp_path / "out", tmp_path / "calls"
    env = dict(os.environ, PATH=f"{bin_}:/usr/bin:/bin", OUT=str(out), CALLS=str(calls),
               KDA_STAGES="sanitize", KDA_BUDGET="120")
    subprocess.run(["bash", str(tree / "tools" / "gpu" / "session.sh")], env=env, check=True,
                   capture_output=True, text=True, timeout=120)
    summary = (out / "summary.txt").read_text()
    lines = {ln.split(" rc=")[0]: ln for ln in summary.splitlines() if " rc=" in ln}
    assert lines["sanitize-racecheck-stream-fp32"].startswith("sanitize-racecheck-stream-fp32 rc=9")
    assert lines["sanitize-racecheck-stream-fp32-alone"].startswith(
        "sanitize-racecheck-stream-fp32-alone rc=0")
    # a hazard and a failed check are results, not vanished programs: no second run
    assert "rc=9" in lines["sanitize-racecheck-tail-bf16"]
    assert "rc=9" in lines["sanitize-racecheck-wide-fp32"]
    assert "sanitize-racecheck-tail-bf16-alone" not in lines
    assert "sanitize-racecheck-wide-fp32-alone" not in lines
    ran = calls.read_text().splitlines()
    assert ran.count("racecheck cutedsl:stream 8 100 2 fp32") == 2
    assert ran.count("racecheck cutedsl:stream4t 8 100 2 bf16") == 1
    # every other run once: 3 tools x (2 dtypes x 11 steps + cuda's bf16) and the retry
    assert len(ran) == 3 * 23 + 1
