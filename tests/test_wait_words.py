"""`veild chat` and Studio say a wait in the same words (provider.retry, turn.admitted):
daemon/cli/render.py: wait_text against Studio's own fmtWait (daemon/studio/js/retry.js),
run by node on the same values — ties included, where Python's rounding and
JavaScript's differ (1250 ms: "1.3 s" in both)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import daemon
from daemon.cli.render import wait_text

RETRY_JS = Path(daemon.__file__).parent / "studio" / "js" / "retry.js"
VALUES = [0, 0.4, 0.5, 1.5, 2.5, 849.5, 850, 999.4, 999.5, 999.6, 1000, 1049, 1050, 1149,
          1150, 1250, 1350, 2250, 4449.9, 9949, 9950, 9951, 9999, 10000, 10499, 10500,
          11500, 12500, 99500, 120_000, *range(1000, 12_000, 37)]


def test_the_cli_says_a_wait_as_studio_does() -> None:
    node = shutil.which("node")
    assert node is not None, "node is needed (.ci/run installs it with npm)"
    script = (f"import({json.dumps(RETRY_JS.as_uri())}).then(m => console.log(JSON.stringify("
              f"{json.dumps(VALUES)}.map(m.fmtWait))))")
    out = subprocess.run([node, "--input-type=module", "-e", script], check=True,
                         capture_output=True, text=True, timeout=30).stdout
    studio = json.loads(out)
    assert [wait_text(v) for v in VALUES] == studio
