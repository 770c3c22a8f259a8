"""The OCI images of atmost: what `make oci` built (target/oci: the layouts, archives and digest
files scripts/oci_image.py writes), read with standard tools (skopeo). For tests/e2e only: the
files tier renders the manifests with stand-in digests (tests/support/manifests.py, STAND_IN).
"""

from __future__ import annotations

import json
import subprocess
from functools import lru_cache

from tests.support.manifests import DIGEST_RE
from tests.support.stack import ROOT

OCI_DIR = ROOT / "target" / "oci"


def built_digest(name: str) -> str:
    """The manifest digest `make oci` printed for image `name`, checked against what skopeo (a
    standard OCI tool) reads from the image itself."""
    digest_file = OCI_DIR / f"{name}.digest"
    assert digest_file.is_file(), f"{digest_file} missing: run `make oci` first"
    digest = digest_file.read_text().strip()
    assert DIGEST_RE.fullmatch(digest), digest
    inspected = subprocess.run(["skopeo", "inspect", "--format", "{{.Digest}}", f"oci:{OCI_DIR / name}"],
                               capture_output=True, text=True, timeout=60)
    assert inspected.returncode == 0, inspected.stderr
    assert inspected.stdout.strip() == digest, f"{digest_file} does not name the image in {OCI_DIR / name}"
    return digest


@lru_cache(maxsize=1)
def built() -> dict[str, str]:
    return {"ledger": built_digest("atmost-ledger"), "filter": built_digest("atmost-filter")}


@lru_cache(maxsize=1)
def ledger_image_config() -> dict:
    result = subprocess.run(["skopeo", "inspect", "--config", f"oci:{OCI_DIR / 'atmost-ledger'}"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["config"]
