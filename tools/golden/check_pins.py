"""Exit 0 when every `name==version` pin of a requirements file is installed in the running interpreter
(a local build suffix such as +cpu is ignored); else name what differs, for LABEL, and exit 1.

Usage: VENV/bin/python tools/golden/check_pins.py requirements.txt LABEL
"""
import sys
from importlib.metadata import version, PackageNotFoundError

bad = []
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if not line:
        continue
    name, want = line.split("==")
    try:
        have = version(name).split("+")[0]
    except PackageNotFoundError:
        have = None
    if have != want:
        bad.append(f"{name}: {have} (want {want})")
if bad:
    print(f"{sys.argv[2]} incomplete: " + "; ".join(bad), file=sys.stderr)
    sys.exit(1)
