"""The OCI images of atmost: the packager (scripts/oci_image.py) run on given inputs and its output
read back, blob by blob and with standard tools (skopeo), for the recipe's own checks
(tests/files/test_oci_recipe.py, on stand-in inputs) and for the images `make oci-test` built from the
real ones (tests/e2e/test_oci.py).

What `make oci-test` built (target/oci-test: the layouts, archives and digest files scripts/oci_image.py
writes) is for tests/e2e only: the files tier renders the manifests with stand-in digests
(tests/support/manifests.py, STAND_IN).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

from tests.support.manifests import DIGEST_RE
from tests.support.stack import ROOT

SCRIPT = ROOT / "scripts" / "oci_image.py"
# `make oci-test`: the recipe of `make oci` over the debug ledger (target/oci is the release pair a
# rollout pushes; no suite builds it).
OCI_DIR = ROOT / "target" / "oci-test"
FILTER, LEDGER = "atmost-filter", "atmost-ledger"
TAG = "0.1.0"


def build(image: str, source: Path, out: Path, epoch: str | None = None) -> str:
    """Runs the packager for `image` ("filter" or "ledger") from `source`; returns the digest."""
    flag = "--wasm" if image == "filter" else "--binary"
    env = {"PATH": os.environ["PATH"]} if epoch is None else {"PATH": os.environ["PATH"], "SOURCE_DATE_EPOCH": epoch}
    result = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), image, flag, str(source)],
                            capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr
    name = FILTER if image == "filter" else LEDGER
    digest = (out / f"{name}.digest").read_text().strip()
    assert digest in result.stdout, "the digest is printed"
    return digest


def blob(layout: Path, digest: str) -> bytes:
    algorithm, hex_digest = digest.split(":")
    data = (layout / "blobs" / algorithm / hex_digest).read_bytes()
    assert hashlib.sha256(data).hexdigest() == hex_digest, f"blob {digest} does not match its name"
    return data


def image_parts(layout: Path) -> tuple[dict, dict, dict, list[bytes]]:
    """(index entry, manifest, config, uncompressed layers) of the layout's one image."""
    index = json.loads((layout / "index.json").read_text())
    assert index["schemaVersion"] == 2
    [entry] = index["manifests"]
    assert entry["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    manifest_bytes = blob(layout, entry["digest"])
    assert len(manifest_bytes) == entry["size"]
    manifest = json.loads(manifest_bytes)
    assert manifest["schemaVersion"] == 2
    assert manifest["config"]["mediaType"] == "application/vnd.oci.image.config.v1+json"
    config = json.loads(blob(layout, manifest["config"]["digest"]))
    layers = []
    for layer in manifest["layers"]:
        assert layer["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip"
        compressed = blob(layout, layer["digest"])
        assert len(compressed) == layer["size"]
        layers.append(gzip.decompress(compressed))
    assert config["rootfs"] == {"type": "layers",
                                "diff_ids": ["sha256:" + hashlib.sha256(t).hexdigest() for t in layers]}
    return entry, manifest, config, layers


def same_tree(out_1: Path, out_2: Path) -> None:
    files_1 = sorted(p.relative_to(out_1) for p in out_1.rglob("*") if p.is_file())
    files_2 = sorted(p.relative_to(out_2) for p in out_2.rglob("*") if p.is_file())
    assert files_1 == files_2 and files_1
    for rel in files_1:
        assert (out_1 / rel).read_bytes() == (out_2 / rel).read_bytes(), rel


def skopeo_digest(reference: str) -> str:
    result = subprocess.run(["skopeo", "inspect", "--format", "{{.Digest}}", reference],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


# ---------------------------------------------------------------- what `make oci-test` built


def built_digest(name: str) -> str:
    """The manifest digest `make oci-test` printed for image `name`, checked against what skopeo (a
    standard OCI tool) reads from the image itself."""
    digest_file = OCI_DIR / f"{name}.digest"
    assert digest_file.is_file(), f"{digest_file} missing: run `make oci-test` first"
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
