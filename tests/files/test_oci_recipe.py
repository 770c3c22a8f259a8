"""`make oci`'s recipe: the packager (scripts/oci_image.py) builds the filter and the ledger as OCI
images with umoci, reproducibly (the same inputs give the same digest and the same bytes, a
different input another digest), each read back with standard tools only (skopeo, Python's
tarfile over the blobs): the filter image is Istio's compat variant, one layer holding exactly
plugin.wasm; SOURCE_DATE_EPOCH sets every timestamp; the ledger image's CA bundle is Debian's
package's, never this machine's.

Run on stand-in inputs, so no build is needed: a smallest valid Wasm module for the filter, and
for the ledger a copy of `true`, a real dynamically linked executable, since the recipe copies
the binary and exactly the libraries the loader resolves for it. What needs the real module and
binary or the images `make oci` built (the same digests again, the ledger image's contents, the
unpacked image run as a cluster runs it) is tests/e2e/test_oci.py.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from tests.support.oci import (
    FILTER,
    LEDGER,
    SCRIPT,
    TAG,
    build,
    image_parts,
    same_tree,
    skopeo_digest,
)
from tests.support.stack import ROOT

# The smallest valid Wasm module: the magic number and version 1, no sections.
STAND_IN_WASM = b"\0asm\x01\0\0\0"


@pytest.fixture(scope="module")
def stand_in_wasm(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("stand-in") / "filter.wasm"
    path.write_bytes(STAND_IN_WASM)
    return path


@pytest.fixture(scope="module")
def stand_in_binary(tmp_path_factory) -> Path:
    """A copy of `true`: an executable the loader resolves libraries for, as it does for `atmost`,
    so the recipe's library copying runs as in `make oci`."""
    path = tmp_path_factory.mktemp("stand-in") / "atmost"
    shutil.copy2(shutil.which("true"), path)
    linked = subprocess.run(["ldd", str(path)], capture_output=True, text=True, timeout=30)
    assert linked.returncode == 0 and "libc.so.6 => /" in linked.stdout, linked.stdout + linked.stderr
    return path


# ---------------------------------------------------------------- make oci


def test_make_oci_builds_both_images_with_umoci():
    result = subprocess.run(["make", "-n", "oci"], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "scripts/oci_image.py --out target/oci filter" in result.stdout
    assert "scripts/oci_image.py --out target/oci ledger --binary target/release/atmost" in result.stdout
    # umoci makes the images, GNU tar the layers; the packager writes no tar, gzip or blob itself.
    script = SCRIPT.read_text()
    assert '"umoci", "raw", "add-layer"' in script
    assert not {"import tarfile", "import gzip", "import hashlib"} & set(script.splitlines())


# ---------------------------------------------------------------- the filter image


@pytest.fixture(scope="module")
def filter_builds(tmp_path_factory, stand_in_wasm):
    first, second = tmp_path_factory.mktemp("oci-f1"), tmp_path_factory.mktemp("oci-f2")
    return (build("filter", stand_in_wasm, first), first), (build("filter", stand_in_wasm, second), second)


def test_filter_built_twice_gives_the_same_digest_and_bytes(filter_builds):
    (digest_1, out_1), (digest_2, out_2) = filter_builds
    assert digest_1 == digest_2
    assert digest_1.startswith("sha256:") and len(digest_1) == len("sha256:") + 64
    same_tree(out_1, out_2)


def test_a_different_filter_gives_a_different_digest(filter_builds, stand_in_wasm, tmp_path):
    (digest, _), _ = filter_builds
    other = tmp_path / "other.wasm"
    other.write_bytes(stand_in_wasm.read_bytes() + b"\0")
    assert build("filter", other, tmp_path / "out") != digest


def test_filter_layout_is_an_oci_image_with_one_layer_holding_exactly_plugin_wasm(filter_builds, stand_in_wasm):
    (digest, out), _ = filter_builds
    layout = out / FILTER
    assert json.loads((layout / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    entry, manifest, config, layers = image_parts(layout)
    assert entry["digest"] == digest
    assert entry["annotations"]["org.opencontainers.image.ref.name"] == TAG
    assert manifest["annotations"]["org.opencontainers.image.title"] == FILTER
    assert (config["architecture"], config["os"]) == ("wasm", "wasip1")

    # Istio's compat variant: the (last and only) layer is tar+gzip and contains plugin.wasm.
    [layer] = layers
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        members = tar.getmembers()
        assert [m.name for m in members] == ["plugin.wasm"]
        [member] = members
        assert member.isreg() and member.mode == 0o644
        assert (member.uid, member.gid, member.uname, member.gname) == (0, 0, "", "")
        assert member.mtime == 0
        assert tar.extractfile(member).read() == stand_in_wasm.read_bytes()


def test_filter_archive_holds_the_same_layout(filter_builds):
    (_, out), _ = filter_builds
    with tarfile.open(out / f"{FILTER}.tar") as tar:
        names = sorted(m.name for m in tar.getmembers())
        assert names == sorted(str(p.relative_to(out / FILTER)) for p in (out / FILTER).rglob("*") if p.is_file())
        for name in names:
            assert tar.extractfile(name).read() == (out / FILTER / name).read_bytes()



def test_source_date_epoch_sets_the_timestamps(stand_in_wasm, tmp_path):
    build("filter", stand_in_wasm, tmp_path, epoch="1700000000")
    with tarfile.open(tmp_path / f"{FILTER}.tar") as tar:
        assert {m.mtime for m in tar.getmembers()} == {1700000000}
    _, _, config, [layer] = image_parts(tmp_path / FILTER)
    assert config["created"] == "2023-11-14T22:13:20Z"
    assert [h["created"] for h in config["history"]] == ["2023-11-14T22:13:20Z"]
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        assert {m.mtime for m in tar.getmembers()} == {1700000000}


def test_skopeo_keeps_the_filter_digest_on_copy(filter_builds, tmp_path):
    """Copying the image, as a push to a registry would, keeps the digest we document."""
    (digest, out), _ = filter_builds
    copied = tmp_path / "copy"
    result = subprocess.run(["skopeo", "copy", "--preserve-digests", f"oci:{out / FILTER}", f"oci:{copied}:{TAG}"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert skopeo_digest(f"oci:{copied}:{TAG}") == digest


# ---------------------------------------------------------------- the ledger image


@pytest.fixture(scope="module")
def ledger_builds(tmp_path_factory, stand_in_binary):
    first, second = tmp_path_factory.mktemp("oci-l1"), tmp_path_factory.mktemp("oci-l2")
    return (build("ledger", stand_in_binary, first), first), (build("ledger", stand_in_binary, second), second)


def test_ledger_built_twice_gives_the_same_digest_and_bytes(ledger_builds):
    (digest_1, out_1), (digest_2, out_2) = ledger_builds
    assert digest_1 == digest_2
    same_tree(out_1, out_2)


def test_ledger_ca_bundle_is_the_packages_not_this_machines(ledger_builds):
    """A CA added on the build machine (/usr/local/share/ca-certificates, in its
    /etc/ssl/certs/ca-certificates.crt) never reaches the image."""
    (_, out), _ = ledger_builds
    _, _, _, [layer] = image_parts(out / LEDGER)
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        bundle = tar.extractfile("etc/ssl/certs/ca-certificates.crt").read()
    for local in sorted(Path("/usr/local/share/ca-certificates").rglob("*.crt")):
        assert local.read_bytes().strip() not in bundle, f"{local} leaked into the image"
    assert bundle.count(b"-----BEGIN CERTIFICATE-----") > 100
