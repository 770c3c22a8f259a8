#!/usr/bin/env python3
"""Packages the atmost filter as an OCI image that Istio can pull (`make oci`).

Standard library only. Writes, under --out (default target/oci):

  atmost-filter/            an OCI image layout (oci-layout, index.json, blobs/sha256/...)
  atmost-filter.tar         the same layout as one tar (for `skopeo copy oci-archive:...`)
  atmost-filter.digest      the image manifest digest, `sha256:<hex>`: the value for the
                            WasmPlugin's `sha256` (hex part) and for `oci://...@sha256:<hex>`

Format: the Wasm image spec's "compat" variant, i.e. an ordinary OCI image whose single
layer (application/vnd.oci.image.layer.v1.tar+gzip) holds exactly one file, `plugin.wasm`.
istio-agent accepts it (it looks for plugin.wasm in the image's last tar+gzip layer), and
unlike the two-layer artifact variant with custom media types it is a plain image that every
registry, mirror and tool (skopeo, crane, podman, scanners) handles.

Reproducible: the same wasm gives the same bytes, hence the same digest. Tar entries have
mtime SOURCE_DATE_EPOCH (default 0), uid/gid 0 without names, mode 0644; gzip has no name
and mtime 0; JSON is written with sorted keys and no whitespace; no timestamps elsewhere.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import shutil
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_WASM = ROOT / "target" / "wasm32-wasip1" / "wasm" / "atmost_filter.wasm"
NAME = "atmost-filter"

MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"


def canonical_json(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def deterministic_tar(entries: list[tuple[str, bytes, int]], mtime: int) -> bytes:
    """A tar of (name, content, mode) entries in name order with fixed metadata."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, content, mode in sorted(entries):
            info = tarfile.TarInfo(name)
            info.size = len(content)
            info.mode = mode
            info.mtime = mtime
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.type = tarfile.REGTYPE
            tar.addfile(info, io.BytesIO(content))
    return buf.getvalue()


def deterministic_gzip(data: bytes) -> bytes:
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as gz:
        gz.write(data)
    return buf.getvalue()


def version() -> str:
    """The workspace version from Cargo.toml (used as the image tag)."""
    for line in (ROOT / "Cargo.toml").read_text().splitlines():
        if line.strip().startswith("version") and "=" in line and '"' in line:
            return line.split('"')[1]
    return "0.0.0"


def build(wasm: Path, out: Path, tag: str, epoch: int) -> dict:
    """Writes the layout, the tar and the digest file under `out`; returns a summary."""
    wasm_bytes = wasm.read_bytes()
    layer_tar = deterministic_tar([("plugin.wasm", wasm_bytes, 0o644)], epoch)
    layer = deterministic_gzip(layer_tar)

    config = {
        "architecture": "wasm",
        "os": "wasip1",
        "config": {},
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + sha256_hex(layer_tar)]},
    }
    config_bytes = canonical_json(config)

    manifest = {
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": {"mediaType": MEDIA_CONFIG, "digest": "sha256:" + sha256_hex(config_bytes),
                   "size": len(config_bytes)},
        "layers": [{"mediaType": MEDIA_LAYER, "digest": "sha256:" + sha256_hex(layer), "size": len(layer),
                    "annotations": {"org.opencontainers.image.title": "plugin.wasm"}}],
        "annotations": {
            "org.opencontainers.image.title": NAME,
            "org.opencontainers.image.version": tag,
            "org.opencontainers.image.licenses": "Apache-2.0",
        },
    }
    manifest_bytes = canonical_json(manifest)
    manifest_digest = "sha256:" + sha256_hex(manifest_bytes)

    index = {
        "schemaVersion": 2,
        "mediaType": MEDIA_INDEX,
        "manifests": [{"mediaType": MEDIA_MANIFEST, "digest": manifest_digest, "size": len(manifest_bytes),
                       "annotations": {"org.opencontainers.image.ref.name": tag}}],
    }
    files = {
        "oci-layout": canonical_json({"imageLayoutVersion": "1.0.0"}),
        "index.json": canonical_json(index),
    }
    for blob in (layer, config_bytes, manifest_bytes):
        files["blobs/sha256/" + sha256_hex(blob)] = blob

    out.mkdir(parents=True, exist_ok=True)
    layout = out / NAME
    if layout.exists():
        shutil.rmtree(layout)
    for rel, data in files.items():
        path = layout / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    archive = deterministic_tar([(rel, data, 0o644) for rel, data in files.items()], epoch)
    (out / f"{NAME}.tar").write_bytes(archive)
    (out / f"{NAME}.digest").write_text(manifest_digest + "\n")
    return {
        "layout": str(layout),
        "archive": str(out / f"{NAME}.tar"),
        "tag": tag,
        "manifest_digest": manifest_digest,
        "wasm_sha256": "sha256:" + sha256_hex(wasm_bytes),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wasm", type=Path, default=DEFAULT_WASM, help="the filter (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=ROOT / "target" / "oci", help="output directory (default: %(default)s)")
    parser.add_argument("--tag", default=None, help="image tag in index.json (default: the workspace version)")
    args = parser.parse_args(argv)
    if not args.wasm.is_file():
        print(f"oci: {args.wasm} not found; build the filter first (make wasm)", file=sys.stderr)
        return 1
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH", "0"))
    summary = build(args.wasm, args.out, args.tag or version(), epoch)
    print(f"OCI image layout  {summary['layout']} (tag {summary['tag']})")
    print(f"OCI archive       {summary['archive']}")
    print(f"manifest digest   {summary['manifest_digest']}   <- WasmPlugin sha256 / oci://...@sha256:")
    print(f"plugin.wasm       {summary['wasm_sha256']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
