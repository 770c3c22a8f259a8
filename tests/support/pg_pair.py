"""A throwaway PostgreSQL primary and streaming standby, for failover tests.

Two clusters of the installed PostgreSQL binaries (`/usr/lib/postgresql/*/bin`, or
`initdb` on PATH) in one temporary directory, on loopback ports picked here: the primary
made with `initdb`, the standby with `pg_basebackup` from it. The standby streams from
the primary through a fault proxy of its own (`PgNode.link`), so a test can cut the
replication stream and nothing else: commits the primary acknowledges while the link is
cut never reach the standby.

Settings are those a team would run: `synchronous_standby_names` names the standby (by
its `application_name`), `synchronous_commit` is `on` unless the test asks for `local`
(the control: asynchronous replication). PostgreSQL refuses to run as root, so as root
every server command runs as the `postgres` user. Every wait is bounded; `stop()` kills
every server process of both clusters and removes the directory, whatever state they are
in.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

from tests.support.fault_proxy import FaultProxy
from tests.support.history import psql
from tests.support.stack import free_port, wait_until

DATABASE = "atmost"


def pg_bindir() -> Path:
    """The directory of `initdb` and `pg_ctl`: on PATH, else the newest Debian install."""
    found = shutil.which("initdb")
    if found and (Path(found).parent / "pg_ctl").exists() and (Path(found).parent / "pg_basebackup").exists():
        return Path(found).parent
    for d in sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: p.parent.name, reverse=True):
        if (d / "initdb").exists() and (d / "pg_ctl").exists() and (d / "pg_basebackup").exists():
            return d
    raise RuntimeError("PostgreSQL server binaries (initdb, pg_ctl, pg_basebackup) not found: "
                       "install Debian's postgresql package")


def _as_pg() -> list[str]:
    if os.getuid() != 0:
        return []
    if shutil.which("runuser") is None:
        raise RuntimeError("running as root without runuser: cannot start PostgreSQL as the postgres user")
    return ["runuser", "-u", "postgres", "--"]


def _children(pid: int) -> list[int]:
    """Every process whose parent is `pid` (a postmaster's backends and auxiliary processes)."""
    kids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(entry.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class PgNode:
    """One cluster: a data directory, a port, and how it is started and killed."""

    def __init__(self, name: str, root: Path, bindir: Path):
        self.name = name  # also its application_name when it streams as a standby
        self.root = root
        self.data = root / name
        self.log_path = root / f"{name}.log"
        self.port = free_port()
        self.bindir = bindir
        self.link: FaultProxy | None = None  # standby → primary, when this node is a standby
        self.starts = 0
        # Called with the node after every start (PgPair's `after_start`).
        self.after_start: Callable[["PgNode"], None] | None = None

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{DATABASE}"

    def run(self, tool: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        r = subprocess.run([*_as_pg(), str(self.bindir / tool), *args], capture_output=True, text=True,
                           timeout=timeout, cwd=self.root)
        if r.returncode != 0:
            raise RuntimeError(f"{tool} {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()[-2000:]}\n"
                               f"server log: {self.log_tail()}")
        return r

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return "(none)"

    def start(self) -> None:
        # Per node on the command line (a base backup copies the configuration files, and a
        # command-line setting wins over ALTER SYSTEM). Each start gets a socket directory of
        # its own: a postmaster killed by kill9() stays a zombie until whoever adopted it reaps
        # it, and PostgreSQL, finding the socket's lock file, takes a zombie's pid for a live
        # postmaster and refuses to start on the same port.
        self.starts += 1
        sockets = self.root / f"{self.name}-sockets-{self.starts}"
        sockets.mkdir()
        if _as_pg():
            shutil.chown(sockets, user="postgres")
        options = f"-c port={self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={sockets}"
        self.run("pg_ctl", "-D", str(self.data), "-l", str(self.log_path), "-w", "-t", "60", "-o", options, "start")
        if self.after_start is not None:
            self.after_start(self)

    def sql(self, statement: str, database: str = DATABASE) -> str:
        return psql(f"postgres://postgres@127.0.0.1:{self.port}/{database}", statement).strip()

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def kill9(self) -> None:
        """The server crashes: SIGKILL to the postmaster and every one of its processes at
        once, none of them left to finish or flush anything."""
        pid = self.postmaster_pid()
        if pid is None or not _alive(pid):
            return
        victims = [pid, *_children(pid)]
        for p in victims:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_until(lambda: not any(_alive(p) for p in victims), 20, f"{self.name}'s processes to die")

    def in_recovery(self) -> bool:
        return self.sql("SELECT pg_is_in_recovery()") == "t"

    def promote(self) -> None:
        """`pg_ctl promote`, waiting until it accepts writes."""
        self.run("pg_ctl", "-D", str(self.data), "-w", "-t", "60", "promote")
        wait_until(lambda: not self.in_recovery(), 30, f"{self.name} out of recovery")

    def set_synchronous_standby(self, name: str) -> None:
        """What an operator (or Patroni, or CloudNativePG) does to this server's
        `synchronous_standby_names`: '' after a promotion, when the standby it names is gone
        (else every commit waits for it forever), a standby's name once one streams again."""
        self.sql(f"ALTER SYSTEM SET synchronous_standby_names = '{name}'")
        self.sql("SELECT pg_reload_conf()")
        wait_until(lambda: self.sql("SHOW synchronous_standby_names") == name, 10,
                   f"{self.name}'s synchronous_standby_names = {name!r}")

    def streaming_standbys(self, state: str = "streaming") -> list[str]:
        """application_name of each standby streaming from this server (and `sync` or
        `async` after a colon)."""
        out = self.sql("SELECT application_name || ':' || sync_state FROM pg_stat_replication "
                       f"WHERE state = '{state}'")
        return [line for line in out.splitlines() if line]

    def kill_processes(self) -> None:
        """Teardown: whatever runs under this data directory dies."""
        try:
            self.kill9()
        except (TimeoutError, OSError):
            pass
        if self.link is not None:
            self.link.stop()
            self.link = None


class PgPair:
    """A primary and a synchronous standby, and the moves of a failover."""

    def __init__(self, synchronous_commit: str = "on", name: str = "pg-pair", fsync: bool = False,
                 parent: Path | None = None, after_start: Callable[[PgNode], None] | None = None):
        """`fsync`: on for a test whose disk is part of the fault (a slow disk slows commits
        only when they wait for it); `parent`: the directory (file system) the pair lives in;
        `after_start`: called with each node after each of its starts."""
        if synchronous_commit not in ("on", "local", "remote_write", "remote_apply"):
            raise ValueError(f"synchronous_commit {synchronous_commit!r}")
        self.synchronous_commit = synchronous_commit
        self.fsync = fsync
        self.bindir = pg_bindir()
        self.root = Path(tempfile.mkdtemp(prefix=f"atmost-{name}-", dir=parent))
        if _as_pg():
            shutil.chown(self.root, user="postgres")
        self.a = PgNode("a", self.root, self.bindir)
        self.b = PgNode("b", self.root, self.bindir)
        for node in (self.a, self.b):
            node.after_start = after_start
        self.primary, self.standby = self.a, self.b

    @property
    def url(self) -> str:
        """Both servers in one URL: a client connects to whichever accepts writes."""
        return (f"postgres://postgres@127.0.0.1:{self.a.port},127.0.0.1:{self.b.port}/{DATABASE}"
                "?target_session_attrs=read-write")

    def start(self) -> "PgPair":
        a = self.a
        a.run("initdb", "-D", str(a.data), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync")
        with open(a.data / "postgresql.conf", "a") as conf:
            # Whatever is here a base backup copies: the settings of the whole pair. fsync
            # off unless asked: the tests kill processes, never the machine, so the page cache
            # survives.
            conf.write("\n".join([
                "", "wal_level = replica", "max_wal_senders = 8", "hot_standby = on",
                f"fsync = {'on' if self.fsync else 'off'}",
                "max_connections = 100", "wal_keep_size = '64MB'",
                f"synchronous_commit = {self.synchronous_commit}",
                f"synchronous_standby_names = '{self.b.name}'", "",
            ]))
        a.start()
        # No standby streams yet, so no commit could be acknowledged synchronously.
        a.sql(f"CREATE DATABASE {DATABASE}", database="postgres?options=-c%20synchronous_commit%3Dlocal")
        self.attach_standby(self.b, self.a)
        return self

    def attach_standby(self, standby: PgNode, primary: PgNode) -> None:
        """(Re)builds `standby` from a base backup of `primary` and starts it streaming
        through its own link proxy; the primary then names it synchronous."""
        if standby.link is not None:
            standby.link.stop()
        standby.kill9()
        shutil.rmtree(standby.data, ignore_errors=True)
        standby.link = FaultProxy(primary.port, name=f"pg-link-{standby.name}").start()
        standby.run("pg_basebackup", "-h", "127.0.0.1", "-p", str(primary.port), "-U", "postgres", "-D",
                    str(standby.data), "-X", "stream", "-c", "fast", "--no-sync")
        (standby.data / "standby.signal").touch()
        if _as_pg():
            shutil.chown(standby.data / "standby.signal", user="postgres")
        with open(standby.data / "postgresql.auto.conf", "a") as conf:
            conf.write(f"\nprimary_conninfo = 'host=127.0.0.1 port={standby.link.port} user=postgres "
                       f"application_name={standby.name}'\n"
                       # A cut link is retried quickly once it heals.
                       "wal_retrieve_retry_interval = '500ms'\n")
        standby.start()
        self.primary, self.standby = primary, standby
        if primary.sql("SHOW synchronous_standby_names") != standby.name:
            primary.set_synchronous_standby(standby.name)
        self.wait_streaming()

    def wait_streaming(self, within: float = 30.0) -> None:
        """The standby streams and the primary counts it as synchronous."""
        want = f"{self.standby.name}:sync"
        wait_until(lambda: want in self.primary.streaming_standbys(), within,
                   f"{self.standby.name} streaming synchronously from {self.primary.name}")

    def wait_caught_up(self, within: float = 20.0) -> None:
        """The standby has replayed everything the primary has committed so far, asynchronous
        commits included (the ledger's report groups): their records may still be in the WAL
        buffers, past pg_current_wal_lsn() (what was written), until the WAL writer writes them,
        so the position waited for is where the primary inserts."""
        lsn = self.primary.sql("SELECT pg_current_wal_insert_lsn()")
        wait_until(lambda: self.standby.sql(f"SELECT pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn") == "t", within,
                   f"{self.standby.name} replaying up to {lsn}")

    def cut_replication(self) -> None:
        """The stream stops: the link refuses the standby and resets what it holds. Returns
        once the primary has no standby any more."""
        assert self.standby.link is not None
        self.standby.link.set_mode("refuse", cut=True)
        wait_until(lambda: not self.primary.streaming_standbys() and not self.primary.streaming_standbys("catchup"),
                   20, f"{self.primary.name} without a standby")

    def kill_primary(self) -> float:
        """kill -9 the primary; returns the moment it was dead (time.monotonic())."""
        self.primary.kill9()
        return time.monotonic()

    def promote_standby(self) -> tuple[PgNode, float, float]:
        """Promotes the standby and clears the `synchronous_standby_names` it inherited (the
        standby it names is gone, or is itself): it is the primary now, the dead one its
        standby to be. Returns it, the moment it left recovery and the moment the setting
        was cleared (time.monotonic())."""
        old, new = self.primary, self.standby
        new.promote()
        promoted = time.monotonic()
        new.set_synchronous_standby("")
        cleared = time.monotonic()
        if new.link is not None:
            new.link.stop()
            new.link = None
        self.primary, self.standby = new, old
        return new, promoted, cleared

    def fail_over(self) -> tuple[PgNode, float]:
        """kill -9 the primary and promote the standby at once: the new primary and the
        moment of the kill."""
        killed = self.kill_primary()
        return self.promote_standby()[0], killed

    def stop(self) -> None:
        for node in (self.a, self.b):
            node.kill_processes()
        shutil.rmtree(self.root, ignore_errors=True)
