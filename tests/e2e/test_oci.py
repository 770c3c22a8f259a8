"""`make oci-test`: the filter and the ledger as OCI images, built by umoci (scripts/oci_image.py)
from the built module and the debug ledger the suites run, by the recipe of `make oci` (which
packages the release build instead: the recipe does not depend on how the binary was built). The
packager run again on them gives the digests `make oci-test` printed, which skopeo reads from the
layouts and the archives; the ledger image holds the binary, exactly the libraries this machine's
loader resolves for it, Debian's CA certificates and its user, and nothing else. The ledger image
is run the way a cluster runs it: its root unpacked and mounted read-only, the data directory a
separate writable volume, user 65532, nothing of the build tree or the host's files in sight (a
chroot in a mount namespace of its own).

The recipe itself on stand-in inputs (reproducible bytes, the filter's layout, the archive,
SOURCE_DATE_EPOCH, skopeo's copy, the ledger's CA bundle): tests/files/test_oci_recipe.py.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import re
import shutil
import subprocess
import tarfile
import urllib.parse
import uuid
from pathlib import Path

import pytest

from tests.support.certificates import make_certificate
from tests.support.oci import FILTER, LEDGER, OCI_DIR, TAG, build, image_parts, same_tree, skopeo_digest
from tests.support.stack import ROOT, WASM, ProcessExited, free_port, http_get, wait_until
from tests.support.tcp_proxy import PgTlsFront

LEDGER_BINARY = ROOT / "target" / "debug" / "atmost"
UID = 65532


# ---------------------------------------------------------------- make oci-test


@pytest.mark.parametrize("name", [FILTER, LEDGER])
def test_make_oci_test_output_is_what_skopeo_reads(name):
    """The digest `make oci-test` printed and wrote is the image's, for skopeo, from the layout and
    from the archive."""
    digest = (OCI_DIR / f"{name}.digest").read_text().strip()
    assert skopeo_digest(f"oci:{OCI_DIR / name}:{TAG}") == digest
    assert skopeo_digest(f"oci-archive:{OCI_DIR / (name + '.tar')}") == digest


def same_as_make_oci_test(out: Path, name: str) -> None:
    """`out` holds the layout and archive of image `name` byte for byte as `make oci-test` wrote them."""
    same_tree(out / name, OCI_DIR / name)
    assert (out / f"{name}.tar").read_bytes() == (OCI_DIR / f"{name}.tar").read_bytes(), name


def test_the_filter_built_again_is_the_image_make_oci_test_built(tmp_path):
    """The packager run again on the built module gives the digest `make oci-test` printed, and the same
    bytes (twice on a stand-in, and the rest of the recipe: tests/files/test_oci_recipe.py)."""
    assert WASM.exists(), "build the filter first (make wasm)"
    digest = build("filter", WASM, tmp_path)
    assert digest == (OCI_DIR / f"{FILTER}.digest").read_text().strip(), "make oci-test built the same image"
    same_as_make_oci_test(tmp_path, FILTER)


# ---------------------------------------------------------------- the ledger image


@pytest.fixture(scope="module")
def ledger_build(tmp_path_factory):
    assert LEDGER_BINARY.exists(), f"{LEDGER_BINARY} missing: build it first (make ledger)"
    out = tmp_path_factory.mktemp("oci-l")
    return build("ledger", LEDGER_BINARY, out), out


def test_the_ledger_built_again_is_the_image_make_oci_test_built(ledger_build):
    """The packager run again on the ledger binary gives the digest `make oci-test` printed, and the
    same bytes (twice on a stand-in: tests/files/test_oci_recipe.py)."""
    digest, out = ledger_build
    assert digest == (OCI_DIR / f"{LEDGER}.digest").read_text().strip(), "make oci-test built the same image"
    same_as_make_oci_test(out, LEDGER)


def package_ca_bundle() -> bytes:
    """Debian's ca-certificates bundle as update-ca-certificates builds it from the package
    alone: the package's certificates, in name order, each ending in a newline."""
    listed = subprocess.run(["dpkg-query", "--listfiles", "ca-certificates"], capture_output=True, text=True,
                            timeout=30, check=True).stdout.split()
    certs = sorted(p for p in listed if p.startswith("/usr/share/ca-certificates/") and p.endswith(".crt"))
    assert len(certs) > 100
    return b"".join(data if data.endswith(b"\n") else data + b"\n" for data in (Path(c).read_bytes() for c in certs))


def loaded_libraries(binary: Path) -> list[str]:
    """What this machine's dynamic loader loads for `binary` (ldd), the loader included."""
    result = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert "not found" not in result.stdout, result.stdout
    return sorted(re.findall(r"(/\S+) \(0x[0-9a-f]+\)", result.stdout))



def test_ledger_image_holds_the_binary_its_libraries_certificates_and_user_and_nothing_else(ledger_build):
    digest, out = ledger_build
    entry, manifest, config, [layer] = image_parts(out / LEDGER)
    assert entry["digest"] == digest and entry["annotations"]["org.opencontainers.image.ref.name"] == TAG
    assert manifest["annotations"]["org.opencontainers.image.title"] == LEDGER
    assert (config["architecture"], config["os"]) == ("amd64", "linux")
    runtime = config["config"]
    assert runtime["User"] == f"{UID}:{UID}"
    assert runtime["Entrypoint"] == ["/usr/local/bin/atmost"] and runtime["Cmd"] == ["ledger"]
    assert list(runtime["Volumes"]) == ["/var/lib/atmost"]
    assert "ATMOST_DATA_DIR=/var/lib/atmost" in runtime["Env"]

    libraries = loaded_libraries(LEDGER_BINARY)
    # glibc's loader, libc, libm, libgcc_s: nothing else is loaded (no NSS module, no libssl).
    assert sorted(Path(p).name for p in libraries) == ["ld-linux-x86-64.so.2", "libc.so.6", "libgcc_s.so.1", "libm.so.6"]
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        members = {m.name.rstrip("/"): m for m in tar.getmembers()}
        files = {"etc/group", "etc/nsswitch.conf", "etc/passwd", "etc/ssl/certs/ca-certificates.crt",
                 "usr/local/bin/atmost", *(p.lstrip("/") for p in libraries)}
        directories = {str(parent) for f in files | {"var/lib/atmost"} for parent in Path(f).parents
                       if str(parent) != "."}
        # No shell, no package manager, no other file: exactly these.
        assert set(members) == files | directories | {"tmp", "var/lib/atmost"}
        assert {name for name, m in members.items() if m.isdir()} == directories | {"tmp", "var/lib/atmost"}
        assert tar.extractfile("usr/local/bin/atmost").read() == LEDGER_BINARY.read_bytes()
        assert members["usr/local/bin/atmost"].mode == 0o755
        for library in libraries:
            assert tar.extractfile(library.lstrip("/")).read() == Path(library).read_bytes(), library
        assert tar.extractfile("etc/ssl/certs/ca-certificates.crt").read() == package_ca_bundle()
        passwd = tar.extractfile("etc/passwd").read().decode()
        assert f"atmost:x:{UID}:{UID}:atmost:/var/lib/atmost:/sbin/nologin" in passwd.splitlines()
        assert f"atmost:x:{UID}:" in tar.extractfile("etc/group").read().decode().splitlines()
        data_dir = members["var/lib/atmost"]
        assert data_dir.isdir() and (data_dir.uid, data_dir.gid, data_dir.mode) == (UID, UID, 0o700)
        assert members["tmp"].mode == 0o1777
        for name, member in members.items():
            assert member.mtime == 0 and member.uname == member.gname == "", name
            if name != "var/lib/atmost":
                assert (member.uid, member.gid) == (0, 0), name
    # The packages those files come from, by version: what a rebuild must match.
    packages = config["history"][0]["created_by"]
    for package in ("libc6", "libgcc-s1", "ca-certificates"):
        version = subprocess.run(["dpkg-query", "--show", "--showformat=${Version}", package], capture_output=True,
                                 text=True, timeout=30, check=True).stdout
        assert f"{package} {version}" in packages


# ---------------------------------------------------------------- running the unpacked ledger image


@pytest.fixture(scope="module")
def unpacked(tmp_path_factory) -> tuple[Path, dict]:
    """The ledger image `make oci-test` built, unpacked by umoci into a runtime bundle: (rootfs, the
    bundle's config.json, which umoci derives from the image's configuration)."""
    assert os.geteuid() == 0, "running the image as user 65532 in a chroot needs root (as `make test` has)"
    bundle = tmp_path_factory.mktemp("bundle") / "ledger"
    result = subprocess.run(["umoci", "unpack", "--rootless", "--image", f"{OCI_DIR / LEDGER}:{TAG}", str(bundle)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    rootfs = bundle / "rootfs"
    return rootfs, json.loads((bundle / "config.json").read_text())


def image_process(spec: dict, args: list[str] | None = None, data_dir: Path | None = None) -> list[str]:
    """The command that runs the image's process as a runtime would: in a mount namespace of its
    own, the unpacked root bind-mounted read-only, `data_dir` mounted at the image's data
    directory, then chroot into it as the image's user. Nothing outside the image is visible."""
    user = spec["process"]["user"]
    mount, chroot = shutil.which("mount"), shutil.which("chroot")
    lines = ['r=$1; d=$2; shift 2', f'{mount} --bind "$r" "$r"', f'{mount} -o remount,bind,ro "$r"']
    if data_dir is not None:
        lines.append(f'{mount} --bind "$d" "$r/var/lib/atmost"')
    lines.append(f'exec {chroot} --userspec={user["uid"]}:{user["gid"]} --groups={user["gid"]} "$r" "$@"')
    argv = args if args is not None else spec["process"]["args"]
    return [shutil.which("unshare"), "--mount", "--propagation", "private", "--", "/bin/sh", "-ec", "\n".join(lines),
            "sh", spec["root"]["path"], str(data_dir or ""), *argv]


def process_env(spec: dict, extra: dict[str, str]) -> dict[str, str]:
    """The image's environment (from the bundle) and `extra`; nothing of the test's own."""
    env = dict(e.split("=", 1) for e in spec["process"]["env"])
    return {**env, **extra}


@pytest.fixture
def spec(unpacked) -> dict:
    rootfs, config = unpacked
    config = json.loads(json.dumps(config))
    config["root"]["path"] = str(rootfs)
    return config


def test_bundle_runs_the_image_as_user_65532(spec):
    assert spec["process"]["user"]["uid"] == UID and spec["process"]["user"]["gid"] == UID
    assert spec["process"]["args"] == ["/usr/local/bin/atmost", "ledger"]
    assert spec["process"]["cwd"] == "/var/lib/atmost"


def test_unpacked_image_prints_its_version(spec):
    entrypoint = spec["process"]["args"][0]
    env = process_env(spec, {})
    result = subprocess.run(image_process(spec, [entrypoint, "--version"]), capture_output=True, text=True,
                            timeout=60, env=env, cwd="/")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"atmost {TAG}"


def test_unpacked_image_has_no_shell(spec):
    env = process_env(spec, {})
    for shell in ("/bin/sh", "/bin/bash", "/usr/bin/sh", "/usr/bin/apt-get", "/usr/bin/dpkg"):
        result = subprocess.run(image_process(spec, [shell, "-c", "true"]), capture_output=True, text=True,
                                timeout=60, env=env, cwd="/")
        assert result.returncode == 127 and "No such file or directory" in result.stderr, (shell, result)


def launch_image_ledger(spec: dict, tmp_path: Path, env: dict[str, str] | None = None):
    """Starts `atmost ledger` as the image starts it (entrypoint, command, environment, user),
    with only the tokens, a loopback listen address and `env` added, and a fresh data volume.
    Returns (process, port, data directory, log file)."""
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    os.chown(data, UID, UID)
    port = free_port()
    env = process_env(spec, {"ATMOST_LISTEN": f"127.0.0.1:{port}", "ATMOST_ADMIN_LISTEN": f"127.0.0.1:{free_port()}",
                             "ATMOST_SERVICE_TOKEN": "image-test-service-token-of-32-bytes-or-more",
                             "ATMOST_ADMIN_TOKEN": "image-test-admin-token-of-32-bytes-or-more", "ATMOST_LOG_FORMAT": "text",
                             "ATMOST_DRAIN_DELAY": "0s",
                             **(env or {})})
    log = tmp_path / "ledger.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(image_process(spec, data_dir=data), stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd="/", start_new_session=True)
    return proc, port, data, log


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=20)


@contextlib.contextmanager
def image_ledger(spec: dict, tmp_path: Path, env: dict[str, str] | None = None):
    """The image's ledger (launch_image_ledger), once /readyz answers 200. Yields (process, port,
    data directory); checks afterwards that nothing was written into the image's root."""
    before = tree_listing(Path(spec["root"]["path"]))
    proc, port, data, log = launch_image_ledger(spec, tmp_path, env)
    try:
        def ready():
            if proc.poll() is not None:
                raise ProcessExited(f"ledger exited {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
            return http_get(f"http://127.0.0.1:{port}/readyz")[0] == 200

        wait_until(ready, 30, f"the unpacked image's ledger on port {port} (log: {log})")
        yield proc, port, data
    finally:
        stop(proc)
    assert tree_listing(Path(spec["root"]["path"])) == before


def test_unpacked_ledger_serves_on_sqlite_from_a_read_only_root(spec, tmp_path):
    """It opens its SQLite store in the data volume and answers /readyz with 200; the process runs
    as 65532 with the unpacked image as its root."""
    assert process_env(spec, {})["ATMOST_DATA_DIR"] == "/var/lib/atmost"
    with image_ledger(spec, tmp_path) as (proc, port, data):
        # The process: user and groups 65532 only, its root the unpacked image.
        status = dict(line.split(":", 1) for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines())
        assert status["Uid"].split() == [str(UID)] * 4 and status["Gid"].split() == [str(UID)] * 4
        assert status["Groups"].split() == [str(UID)]
        assert os.readlink(f"/proc/{proc.pid}/root") == spec["root"]["path"]
        assert Path(f"/proc/{proc.pid}/exe").resolve().name == "atmost"
        # Its store is in the volume, owned by its user.
        store = data / "atmost.sqlite3"
        assert store.is_file() and store.stat().st_uid == UID


@pytest.fixture
def database_url() -> str:
    url = os.environ.get("DATABASE_URL", "").strip()
    assert url, "DATABASE_URL is not set: `make test` provides it (scripts/with-postgres)"
    return url


@pytest.fixture
def pg_schema(database_url):
    schema = f"atmost_image_{uuid.uuid4().hex[:10]}"
    yield schema
    subprocess.run(["psql", database_url, "-qc", f"DROP SCHEMA IF EXISTS {schema} CASCADE"], capture_output=True,
                   timeout=30)


def test_unpacked_ledger_serves_on_postgresql(spec, tmp_path, database_url, pg_schema):
    """The same image on the PostgreSQL store (`make test`'s server, DATABASE_URL, loopback): it
    creates its tables in a schema of its own and answers /readyz with 200; nothing in the volume."""
    with image_ledger(spec, tmp_path, {"ATMOST_STORE": database_url, "ATMOST_PG_SCHEMA": pg_schema}) as (_, port, data):
        assert "atmost_" in http_get(f"http://127.0.0.1:{port}/metrics")[1].decode()
        assert list(data.iterdir()) == []
    tables = subprocess.run(["psql", database_url, "-Atc", "SELECT count(*) FROM information_schema.tables "
                             f"WHERE table_schema = '{pg_schema}'"], capture_output=True, text=True, timeout=30)
    assert tables.returncode == 0 and int(tables.stdout) > 0, tables.stderr


def test_unpacked_ledger_verifies_postgresql_tls_with_the_images_roots(spec, tmp_path, database_url, pg_schema):
    """PostgreSQL over TLS (`sslmode=verify-full`, a server certificate for `localhost`), from
    the unpacked image with no CA configured: the ledger checks the certificate against the
    roots at the image's /etc/ssl/certs/ca-certificates.crt. Debian's roots do not include the
    test's CA, so it refuses the server before the server sees a byte of the protocol; the same
    unpacked image with that CA in the bundle's place connects and is ready."""
    server = urllib.parse.urlsplit(database_url)
    assert server.hostname in ("127.0.0.1", "localhost") and server.port, "a PostgreSQL server on loopback"
    ca, cert, key = make_certificate(tmp_path)
    front = PgTlsFront(server.port, str(cert), str(key)).start()
    credentials = server.netloc.rsplit("@", 1)[0] + "@" if "@" in server.netloc else ""
    store = (f"postgres://{credentials}localhost:{front.port}{server.path}"
             "?sslmode=verify-full&hostaddr=127.0.0.1")
    env = {"ATMOST_STORE": store, "ATMOST_PG_SCHEMA": pg_schema}
    try:
        (tmp_path / "refused").mkdir()
        proc, _, _, log = launch_image_ledger(spec, tmp_path / "refused", env)
        try:
            proc.wait(timeout=60)
        finally:
            stop(proc)
        assert proc.returncode != 0
        assert "UnknownIssuer" in log.read_text(errors="replace"), log.read_text(errors="replace")[-3000:]
        assert front.handshakes == 0 and front.connection_count() >= 1

        # The bundle's place, with the test's CA in it: a copy of the unpacked root.
        trusting = copy.deepcopy(spec)
        trusting["root"]["path"] = str(tmp_path / "rootfs")
        shutil.copytree(spec["root"]["path"], trusting["root"]["path"], symlinks=True)
        bundle = Path(trusting["root"]["path"]) / "etc/ssl/certs/ca-certificates.crt"
        assert bundle.is_file(), "the image's bundle is where the ledger looks"
        shutil.copyfile(ca, bundle)
        (tmp_path / "trusted").mkdir()
        with image_ledger(trusting, tmp_path / "trusted", env):
            assert front.handshakes >= 1
    finally:
        front.stop()


def tree_listing(root: Path) -> list[tuple[str, int, int]]:
    """(path, size, mtime in ns) of everything under `root`."""
    return sorted((str(p.relative_to(root)), p.lstat().st_size, p.lstat().st_mtime_ns) for p in root.rglob("*"))
