#!/usr/bin/env python3
"""Builds atmost's two OCI images with umoci (Debian's `umoci`), reproducibly (`make oci`).

  scripts/oci_image.py filter --wasm target/wasm32-wasip1/wasm/atmost_filter.wasm
  scripts/oci_image.py ledger --binary target/release/atmost

Each writes, under --out (default target/oci), for NAME atmost-filter or atmost-ledger:

  NAME/          an OCI image layout (oci-layout, index.json, blobs/sha256/...), tagged with
                 the workspace version
  NAME.tar       the same layout as one tar (for `skopeo copy oci-archive:...`)
  NAME.digest    the image manifest digest, `sha256:<hex>`: what a registry reference pins
                 (`REGISTRY/NAME@sha256:<hex>`; for the filter also the WasmPlugin's `sha256`)

The filter image is the Wasm image spec's "compat" variant: an ordinary OCI image whose single
tar+gzip layer holds one file, `plugin.wasm` (istio-agent takes plugin.wasm from the image's
last layer). The ledger image is one layer: the `atmost` binary (`make ledger-release`) and
exactly the shared libraries it loads (as the system's dynamic loader resolves them, `ldd`:
glibc's loader, libc, libm, libgcc_s, taken from this machine's Debian packages), Debian's CA
certificates for PostgreSQL TLS, passwd/group files naming the user 65532 it runs as,
nsswitch.conf, an empty data directory owned by that user (a volume) and /tmp; no shell, no
package manager.

Who does what: GNU tar writes each layer's tar from a staging directory with fixed metadata
(names sorted, mtime SOURCE_DATE_EPOCH, numeric owners, no user or group names); umoci makes
the image around it (layout, config, gzip compression, manifest, index), with every
timestamp SOURCE_DATE_EPOCH (default 0). The same inputs give the same bytes, hence the same
digest.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "target" / "oci"
DEFAULT_WASM = ROOT / "target" / "wasm32-wasip1" / "wasm" / "atmost_filter.wasm"
DEFAULT_BINARY = ROOT / "target" / "release" / "atmost"

# The ledger image's user (the Deployment's runAsUser) and where things go in it.
LEDGER_UID = 65532
LEDGER_BINARY = "usr/local/bin/atmost"
LEDGER_DATA_DIR = "var/lib/atmost"
CA_BUNDLE = "etc/ssl/certs/ca-certificates.crt"
# Debian's ca-certificates package: its Mozilla roots, concatenated in name order, are what
# update-ca-certificates writes to /etc/ssl/certs/ca-certificates.crt before any local CA
# (/usr/local/share/ca-certificates) is added. The image takes them from the package, never
# from this machine's bundle.
CA_PACKAGE = "ca-certificates"
CA_PACKAGE_DIR = "/usr/share/ca-certificates/mozilla/"

# GNU tar options that make a layer depend only on the files' names, contents and modes.
TAR_FIXED = ["--format=ustar", "--sort=name", "--numeric-owner"]


class BuildError(Exception):
    pass


def run(args: list[str], **kwargs) -> str:
    result = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"}, **kwargs)
    if result.returncode != 0:
        raise BuildError(f"{' '.join(args)}: exit {result.returncode}\n{result.stderr.strip()}")
    return result.stdout


def version() -> str:
    """The workspace version from Cargo.toml (used as the image tag)."""
    for line in (ROOT / "Cargo.toml").read_text().splitlines():
        if line.strip().startswith("version") and "=" in line and '"' in line:
            return line.split('"')[1]
    return "0.0.0"


def rfc3339(epoch: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def tar_layer(stage: Path, layer: Path, epoch: int, members: list[str], owner: int = 0, append: bool = False,
              exclude: tuple[str, ...] = ()) -> None:
    """Adds `members` (paths under `stage`, directories recursively, but not `exclude`) to the
    tar `layer`, owned by `owner`, with mtime `epoch`."""
    run(["tar", "--append" if append else "--create", "--file", str(layer), "--directory", str(stage),
         *TAR_FIXED, f"--mtime=@{epoch}", f"--owner={owner}", f"--group={owner}",
         *(f"--exclude={path}" for path in exclude), *members])


def make_image(name: str, layer: Path, out: Path, tag: str, epoch: int, created_by: str,
               config: list[str]) -> dict:
    """An OCI layout `out/NAME` holding one image, tagged `tag`: umoci's blank image, its
    configuration set by the `umoci config` flags in `config`, then `layer` as its one layer."""
    created = rfc3339(epoch)
    layout = out / name
    if layout.exists():
        shutil.rmtree(layout)
    image = f"{layout}:{tag}"
    run(["umoci", "init", "--layout", str(layout)])
    run(["umoci", "new", "--image", image])
    run(["umoci", "config", "--image", image, "--no-history", "--created", created,
         "--manifest.annotation", f"org.opencontainers.image.title={name}",
         "--manifest.annotation", f"org.opencontainers.image.version={tag}",
         "--manifest.annotation", "org.opencontainers.image.licenses=Apache-2.0",
         *config])
    run(["umoci", "raw", "add-layer", "--image", image, "--history.created", created,
         "--history.created_by", created_by, str(layer)])
    # umoci keeps the blobs of every intermediate step; only the tagged image's remain.
    run(["umoci", "gc", "--layout", str(layout)])

    index = json.loads((layout / "index.json").read_text())
    [entry] = index["manifests"]
    digest = entry["digest"]
    files = sorted(str(p.relative_to(layout)) for p in layout.rglob("*") if p.is_file())
    archive = out / f"{name}.tar"
    archive.unlink(missing_ok=True)
    run(["tar", "--create", "--file", str(archive), "--directory", str(layout), *TAR_FIXED,
         f"--mtime=@{epoch}", "--owner=0", "--group=0", "--mode=u=rw,go=r", *files])
    (out / f"{name}.digest").write_text(digest + "\n")
    return {"name": name, "layout": layout, "archive": archive, "tag": tag, "digest": digest}


def build_filter(wasm: Path, out: Path, tag: str, epoch: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="oci-filter-") as tmp:
        stage = Path(tmp) / "rootfs"
        stage.mkdir()
        shutil.copyfile(wasm, stage / "plugin.wasm")
        (stage / "plugin.wasm").chmod(0o644)
        layer = Path(tmp) / "layer.tar"
        tar_layer(stage, layer, epoch, ["plugin.wasm"])
        return make_image("atmost-filter", layer, out, tag, epoch, "plugin.wasm: the atmost filter",
                          ["--os", "wasip1", "--architecture", "wasm"])


def ca_certificates() -> tuple[bytes, str]:
    """The package's CA bundle (as update-ca-certificates builds it) and the package version."""
    try:
        listed = run(["dpkg-query", "--listfiles", CA_PACKAGE]).splitlines()
        package_version = run(["dpkg-query", "--show", "--showformat=${Version}", CA_PACKAGE])
    except (BuildError, FileNotFoundError) as e:
        raise BuildError(f"Debian's {CA_PACKAGE} package is needed (apt-get install {CA_PACKAGE}): {e}") from e
    certs = sorted(p for p in listed if p.startswith(CA_PACKAGE_DIR) and p.endswith(".crt"))
    if not certs:
        raise BuildError(f"{CA_PACKAGE} {package_version} lists no certificate under {CA_PACKAGE_DIR}")
    bundle = b""
    for cert in certs:
        pem = Path(cert).read_bytes()
        bundle += pem if pem.endswith(b"\n") else pem + b"\n"
    return bundle, package_version


def shared_libraries(binary: Path) -> list[str]:
    """The absolute paths of the shared objects `binary` loads, its dynamic loader included, as
    this machine's loader resolves them (`ldd`); empty for a statically linked binary."""
    result = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"})
    if "not a dynamic executable" in result.stdout + result.stderr or "statically linked" in result.stdout:
        return []
    if result.returncode != 0:
        raise BuildError(f"ldd {binary}: {result.stderr.strip()}")
    paths = []
    for line in result.stdout.splitlines():
        name, arrow, resolved = line.strip().partition("=>")
        path = (resolved if arrow else name).split("(")[0].strip()
        if arrow and not path.startswith("/"):
            raise BuildError(f"{binary} needs {name.strip()}, which the loader does not find ({path})")
        if path.startswith("/"):  # not linux-vdso.so.1, which the kernel maps
            paths.append(path)
    return sorted(paths)


def owning_package(path: str) -> str:
    """`package version` of the Debian package that installed `path`."""
    try:
        package = run(["dpkg-query", "--search", path]).split(":")[0]
        package_version = run(["dpkg-query", "--show", "--showformat=${Version}", package])
    except (BuildError, FileNotFoundError) as e:
        raise BuildError(f"{path} belongs to no Debian package: {e}") from e
    return f"{package} {package_version}"


def build_ledger(binary: Path, out: Path, tag: str, epoch: int) -> dict:
    bundle, ca_version = ca_certificates()
    libraries = shared_libraries(binary)
    packages = sorted({owning_package(path) for path in libraries})
    with tempfile.TemporaryDirectory(prefix="oci-ledger-") as tmp:
        stage = Path(tmp) / "rootfs"
        files = {
            LEDGER_BINARY: (binary.read_bytes(), 0o755),
            CA_BUNDLE: (bundle, 0o644),
            "etc/passwd": (f"root:x:0:0:root:/root:/sbin/nologin\n"
                           f"atmost:x:{LEDGER_UID}:{LEDGER_UID}:atmost:/{LEDGER_DATA_DIR}:/sbin/nologin\n".encode(), 0o644),
            "etc/group": (f"root:x:0:\natmost:x:{LEDGER_UID}:\n".encode(), 0o644),
            # Host names: /etc/hosts (which a container runtime provides) before DNS.
            "etc/nsswitch.conf": (b"hosts: files dns\n", 0o644),
        }
        # Each library at the path the loader found it under (the binary's interpreter at its
        # PT_INTERP path), with the contents of the file that path leads to.
        for path in libraries:
            files[path.lstrip("/")] = (Path(path).read_bytes(), 0o755)
        for rel, (data, mode) in files.items():
            path = stage / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            path.chmod(mode)
        (stage / "tmp").mkdir()
        (stage / LEDGER_DATA_DIR).mkdir(parents=True)
        for directory in [p for p in stage.rglob("*") if p.is_dir()]:
            directory.chmod(0o755)
        (stage / "tmp").chmod(0o1777)
        (stage / LEDGER_DATA_DIR).chmod(0o700)
        layer = Path(tmp) / "layer.tar"
        # Everything root's, except the data directory: the user's own (a volume mounted there
        # starts out as the image's directory in runtimes that copy it).
        top = sorted({rel.split("/")[0] for rel in files} | {"tmp", "var"})
        tar_layer(stage, layer, epoch, top, exclude=(LEDGER_DATA_DIR,))
        tar_layer(stage, layer, epoch, [LEDGER_DATA_DIR], owner=LEDGER_UID, append=True)
        summary = make_image(
            "atmost-ledger", layer, out, tag, epoch,
            f"atmost {tag}, {', '.join(packages + [f'{CA_PACKAGE} {ca_version}'])}, user {LEDGER_UID}",
            ["--os", "linux", "--architecture", "amd64",
             "--config.user", f"{LEDGER_UID}:{LEDGER_UID}",
             "--config.entrypoint", f"/{LEDGER_BINARY}",
             "--config.cmd", "ledger",
             "--config.env", f"ATMOST_DATA_DIR=/{LEDGER_DATA_DIR}",
             "--config.env", "ATMOST_LISTEN=0.0.0.0:8081",
             "--config.exposedports", "8081/tcp",
             "--config.volume", f"/{LEDGER_DATA_DIR}",
             "--config.workingdir", f"/{LEDGER_DATA_DIR}"])
        summary["packages"] = packages + [f"{CA_PACKAGE} {ca_version}"]
        return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default: %(default)s)")
    parser.add_argument("--tag", default=None, help="image tag in index.json (default: the workspace version)")
    images = parser.add_subparsers(dest="image", required=True)
    filter_args = images.add_parser("filter", help="the Wasm filter image (atmost-filter)")
    filter_args.add_argument("--wasm", type=Path, default=DEFAULT_WASM, help="the filter (default: %(default)s)")
    ledger_args = images.add_parser("ledger", help="the ledger image (atmost-ledger)")
    ledger_args.add_argument("--binary", type=Path, default=DEFAULT_BINARY,
                             help="the atmost binary (default: %(default)s)")
    args = parser.parse_args(argv)

    source = args.wasm if args.image == "filter" else args.binary
    if not source.is_file():
        hint = "make wasm" if args.image == "filter" else "make ledger-release"
        print(f"oci: {source} not found; build it first ({hint})", file=sys.stderr)
        return 1
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH", "0"))
    tag = args.tag or version()
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        if args.image == "filter":
            summary = build_filter(source, args.out, tag, epoch)
        else:
            summary = build_ledger(source, args.out, tag, epoch)
    except BuildError as e:
        print(f"oci: {e}", file=sys.stderr)
        return 1
    print(f"{summary['name']:<14} {summary['digest']}   {summary['layout']} (tag {summary['tag']}), "
          f"{summary['archive'].name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
