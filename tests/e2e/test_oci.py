"""`make oci` packaging: an OCI image Istio can pull, built reproducibly (same digest twice)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.support.stack import ROOT, WASM

SCRIPT = ROOT / "scripts" / "oci_image.py"
NAME = "atmost-filter"


def build(wasm: Path, out: Path, epoch: str | None = None) -> str:
    env = None if epoch is None else {"SOURCE_DATE_EPOCH": epoch, "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, str(SCRIPT), "--wasm", str(wasm), "--out", str(out)],
                            capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr
    return (out / f"{NAME}.digest").read_text().strip()


def blob(layout: Path, digest: str) -> bytes:
    algorithm, hex_digest = digest.split(":")
    data = (layout / "blobs" / algorithm / hex_digest).read_bytes()
    assert hashlib.sha256(data).hexdigest() == hex_digest, f"blob {digest} does not match its name"
    return data


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    assert WASM.exists(), "build the filter first (make wasm)"
    first, second = tmp_path_factory.mktemp("oci-1"), tmp_path_factory.mktemp("oci-2")
    return (build(WASM, first), first), (build(WASM, second), second)


def test_building_twice_gives_the_same_digest_and_bytes(builds):
    (digest_1, out_1), (digest_2, out_2) = builds
    assert digest_1 == digest_2
    assert digest_1.startswith("sha256:") and len(digest_1) == len("sha256:") + 64
    assert (out_1 / f"{NAME}.tar").read_bytes() == (out_2 / f"{NAME}.tar").read_bytes()
    files_1 = sorted(p.relative_to(out_1) for p in (out_1 / NAME).rglob("*") if p.is_file())
    files_2 = sorted(p.relative_to(out_2) for p in (out_2 / NAME).rglob("*") if p.is_file())
    assert files_1 == files_2
    for rel in files_1:
        assert (out_1 / rel).read_bytes() == (out_2 / rel).read_bytes(), rel


def test_a_different_filter_gives_a_different_digest(builds, tmp_path):
    (digest, _), _ = builds
    other = tmp_path / "other.wasm"
    other.write_bytes(WASM.read_bytes() + b"\0")
    assert build(other, tmp_path / "out") != digest


def test_layout_is_an_oci_image_with_one_layer_holding_exactly_plugin_wasm(builds):
    (digest, out), _ = builds
    layout = out / NAME
    assert json.loads((layout / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads((layout / "index.json").read_text())
    assert index["mediaType"] == "application/vnd.oci.image.index.v1+json"
    [entry] = index["manifests"]
    assert entry["digest"] == digest
    assert entry["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    assert entry["annotations"]["org.opencontainers.image.ref.name"]

    manifest_bytes = blob(layout, digest)
    assert len(manifest_bytes) == entry["size"]
    manifest = json.loads(manifest_bytes)
    assert manifest["schemaVersion"] == 2
    assert manifest["config"]["mediaType"] == "application/vnd.oci.image.config.v1+json"
    config = json.loads(blob(layout, manifest["config"]["digest"]))

    # Istio's compat variant: the (last and only) layer is tar+gzip and contains plugin.wasm.
    [layer] = manifest["layers"]
    assert layer["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip"
    compressed = blob(layout, layer["digest"])
    assert len(compressed) == layer["size"]
    assert compressed[:2] == b"\x1f\x8b" and compressed[3] & 0x08 == 0, "gzip without a file name"
    assert compressed[4:8] == b"\0\0\0\0", "gzip mtime 0"
    uncompressed = gzip.decompress(compressed)
    assert config["rootfs"] == {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(uncompressed).hexdigest()]}

    with tarfile.open(fileobj=io.BytesIO(uncompressed)) as tar:
        members = tar.getmembers()
        assert [m.name for m in members] == ["plugin.wasm"]
        [member] = members
        assert member.isreg() and member.mode == 0o644
        assert (member.uid, member.gid, member.uname, member.gname) == (0, 0, "", "")
        assert member.mtime == 0
        assert tar.extractfile(member).read() == WASM.read_bytes()


def test_archive_holds_the_same_layout(builds):
    (_, out), _ = builds
    with tarfile.open(out / f"{NAME}.tar") as tar:
        names = sorted(m.name for m in tar.getmembers())
        assert names == sorted(str(p.relative_to(out / NAME)) for p in (out / NAME).rglob("*") if p.is_file())
        for name in names:
            assert tar.extractfile(name).read() == (out / NAME / name).read_bytes()


def test_source_date_epoch_sets_the_timestamps(tmp_path):
    assert WASM.exists(), "build the filter first (make wasm)"
    build(WASM, tmp_path, epoch="1700000000")
    with tarfile.open(tmp_path / f"{NAME}.tar") as tar:
        assert {m.mtime for m in tar.getmembers()} == {1700000000}


def test_make_oci_runs_the_packager():
    result = subprocess.run(["make", "-n", "oci"], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "scripts/oci_image.py" in result.stdout and "target/oci" in result.stdout


def test_skopeo_reads_the_image_and_keeps_its_digest_on_copy(builds, tmp_path):
    """A standard OCI tool (skopeo, from Debian) sees the digest we document, and copying
    the image, as a push to a registry would, keeps it."""
    (digest, out), _ = builds
    layout = out / NAME
    inspected = subprocess.run(["skopeo", "inspect", "--format", "{{.Digest}}", f"oci:{layout}"],
                               capture_output=True, text=True, timeout=60)
    assert inspected.returncode == 0, inspected.stderr
    assert inspected.stdout.strip() == digest
    copied = tmp_path / "copy"
    result = subprocess.run(["skopeo", "copy", "--preserve-digests", f"oci:{layout}", f"oci:{copied}:0.1.0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    again = subprocess.run(["skopeo", "inspect", "--format", "{{.Digest}}", f"oci:{copied}:0.1.0"],
                           capture_output=True, text=True, timeout=60)
    assert again.stdout.strip() == digest
    archive = subprocess.run(["skopeo", "inspect", "--format", "{{.Digest}}", f"oci-archive:{out / (NAME + '.tar')}"],
                             capture_output=True, text=True, timeout=60)
    assert archive.returncode == 0 and archive.stdout.strip() == digest, archive.stderr
