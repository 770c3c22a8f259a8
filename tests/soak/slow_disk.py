"""A disk that can be made slow: PostgreSQL's data directories on a file system of their own
(ext4 on a loop device), whose writes a cgroup throttles while the fault lasts.

The kernel's block throttle caps the write operations per second the cgroup's processes issue
to that one device (cgroup v1 `blkio.throttle.write_iops_device`, or v2 `io.max` `wiops=`).
PostgreSQL runs with `fsync = on` there, so every commit waits for its WAL flush, and a
throttled flush is a slow commit, as on a saturated or failing disk. Each server process is
moved into the cgroup when it starts (PgPair's `after_start`); the backends it forks later
are born in it.

`SlowDisk.open()` returns None with the reason when this machine cannot do it (not root, no
loop device, no mount, no block throttle, or a throttle that does not slow a synced write):
the soak then delays the store's links instead and says so in its report.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from tests.support.pg_pair import _children

IMAGE_MB = 4096  # sparse: only what PostgreSQL writes takes space
# The self-check: this many synced 4 KiB writes at this cap must take at least their share.
CHECK_WRITES, CHECK_IOPS = 6, 10


def _run(*argv: str, timeout: float = 60) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()[-500:]}")
    return r.stdout.strip()


def _cgroup_root() -> tuple[str, Path] | None:
    """("v1", the blkio hierarchy) or ("v2", a unified hierarchy with the io controller)."""
    v1 = Path("/sys/fs/cgroup/blkio")
    if (v1 / "blkio.throttle.write_iops_device").exists():
        return "v1", v1
    for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        controllers = root / "cgroup.controllers"
        if controllers.exists() and "io" in controllers.read_text().split():
            return "v2", root
    return None


class SlowDisk:
    def __init__(self, root: Path, flavour: str, cgroups: Path):
        self.root = root
        self.image = root / "disk.img"
        self.mount_point = root / "mnt"
        self.flavour = flavour
        self.cgroup = cgroups / f"atmost-soak-{uuid.uuid4().hex[:8]}"
        self.device: str | None = None
        self.mounted = False
        self.major_minor = ""
        self.check = ""

    @classmethod
    def open(cls) -> tuple["SlowDisk | None", str]:
        """A ready slow disk and how it was checked, or None and why not."""
        if os.geteuid() != 0:
            return None, "not root: no loop device or cgroup"
        found = _cgroup_root()
        if found is None:
            return None, "no block I/O throttle (cgroup v1 blkio or v2 io controller)"
        if not all(shutil.which(t) for t in ("losetup", "mkfs.ext4", "mount", "umount")):
            return None, "losetup, mkfs.ext4, mount or umount missing"
        disk = cls(Path(tempfile.mkdtemp(prefix="atmost-soak-disk-")), *found)
        try:
            disk._setup()
            disk._self_check()
        except Exception as e:  # noqa: BLE001 - any failure means: use the stand-in
            disk.close()
            return None, f"{type(e).__name__}: {e}"
        return disk, disk.check

    def _setup(self) -> None:
        with open(self.image, "wb") as f:
            f.truncate(IMAGE_MB * 1024 * 1024)
        self.device = _run("losetup", "--find", "--show", str(self.image))
        _run("mkfs.ext4", "-q", "-F", self.device)
        self.mount_point.mkdir()
        _run("mount", self.device, str(self.mount_point))
        self.mounted = True
        # PostgreSQL runs as its own user: it must reach the mount point.
        for d in (self.root, self.mount_point):
            os.chmod(d, 0o755)
        rdev = os.stat(self.device).st_rdev
        self.major_minor = f"{os.major(rdev)}:{os.minor(rdev)}"
        if self.flavour == "v2":
            subtree = self.cgroup.parent / "cgroup.subtree_control"
            if "io" not in subtree.read_text().split():
                subtree.write_text("+io")
        self.cgroup.mkdir()

    def _self_check(self) -> None:
        """A synced write per step from a process in the cgroup: fast unthrottled, at least
        CHECK_WRITES / CHECK_IOPS seconds throttled."""
        probe = self.mount_point / "probe"
        code = ("import os,time\n"
                f"fd=os.open({str(probe)!r}, os.O_WRONLY|os.O_CREAT)\nt=time.monotonic()\n"
                f"for _ in range({CHECK_WRITES}):\n os.write(fd, b'x'*4096); os.fdatasync(fd)\n"
                "print(time.monotonic()-t)\n")

        def timed() -> float:
            p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                                 preexec_fn=lambda: (self.cgroup / "cgroup.procs").write_text(str(os.getpid())))
            out, _ = p.communicate(timeout=60)
            if p.returncode != 0:
                raise RuntimeError("the self-check's writer failed")
            return float(out)

        fast = timed()
        self.slow(CHECK_IOPS)
        try:
            slow = timed()
        finally:
            self.heal()
        floor = (CHECK_WRITES - 1) / CHECK_IOPS
        if slow < floor:
            raise RuntimeError(f"the throttle did not slow synced writes ({slow:.2f} s throttled, "
                               f"{fast:.2f} s not; expected at least {floor:.2f} s)")
        probe.unlink()
        self.check = (f"{CHECK_WRITES} synced 4 KiB writes took {fast:.3f} s, {slow:.2f} s at "
                      f"{CHECK_IOPS} write IOPS (cgroup {self.flavour}, loop device {self.major_minor})")

    def confine(self, pids: list[int]) -> None:
        for pid in pids:
            try:
                (self.cgroup / "cgroup.procs").write_text(str(pid))
            except (ProcessLookupError, OSError):
                pass  # gone already

    def confine_tree(self, pid: int | None) -> None:
        """A process and its children (a postmaster and the processes it started)."""
        if pid is not None:
            self.confine([pid, *_children(pid)])

    def slow(self, write_iops: int) -> None:
        if self.flavour == "v1":
            (self.cgroup / "blkio.throttle.write_iops_device").write_text(f"{self.major_minor} {write_iops}")
        else:
            (self.cgroup / "io.max").write_text(f"{self.major_minor} wiops={write_iops}")

    def heal(self) -> None:
        if self.flavour == "v1":
            (self.cgroup / "blkio.throttle.write_iops_device").write_text(f"{self.major_minor} 0")
        else:
            (self.cgroup / "io.max").write_text(f"{self.major_minor} wiops=max")

    def close(self) -> None:
        """Unthrottles, removes the cgroup (its processes are gone by now, or moved out),
        unmounts, detaches the loop device and removes the image; each step bounded."""
        if self.cgroup.exists():
            try:
                self.heal()
            except OSError:
                pass
            procs = self.cgroup / "cgroup.procs"
            for pid in procs.read_text().split() if procs.exists() else []:
                try:
                    (self.cgroup.parent / "cgroup.procs").write_text(pid)
                except OSError:
                    pass
            deadline = time.monotonic() + 10
            while self.cgroup.exists() and time.monotonic() < deadline:
                try:
                    self.cgroup.rmdir()
                except OSError:
                    time.sleep(0.2)
        if self.mounted:
            try:
                _run("umount", str(self.mount_point))
            except (RuntimeError, subprocess.TimeoutExpired):
                subprocess.run(["umount", "-l", str(self.mount_point)], capture_output=True, timeout=30)
            self.mounted = False
        if self.device:
            subprocess.run(["losetup", "-d", self.device], capture_output=True, timeout=30)
            self.device = None
        shutil.rmtree(self.root, ignore_errors=True)
