"""The files tier: checks that read the repository's files and run local tools on them (kubectl
kustomize, promtool, umoci and skopeo, schema and CEL validators). Nothing here needs a build
output (no `cargo build`, no Wasm module, no `make oci`) or starts a server, so this tier runs
before the builds and fails fast; what needs those stays in tests/e2e.

No fixtures of its own: the tests import the repository's helpers from tests/support.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
