//! Files the ledger reads again when they change, without a restart: the TLS certificate and
//! key (crate::tls) and the admin tokens (crate::admins). Each is looked at about once a
//! second, by its metadata alone; what was read from it is swapped whole for the requests
//! that follow.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use tokio::task::JoinHandle;

/// How often the files are looked at for a change: a change is in force within about this
/// long.
pub const RELOAD_CHECK_INTERVAL: Duration = Duration::from_secs(1);

/// What tells a changed file from an unchanged one without reading it: its modification time,
/// length and, on Unix, inode (a Kubernetes Secret volume swaps a symlink to new files).
#[derive(Debug, Clone, PartialEq, Eq)]
struct FileStamp {
    modified: Option<SystemTime>,
    len: u64,
    inode: u64,
}

impl FileStamp {
    fn of(path: &Path) -> io::Result<Self> {
        let meta = std::fs::metadata(path)?;
        Ok(FileStamp {
            modified: meta.modified().ok(),
            len: meta.len(),
            inode: inode(&meta),
        })
    }
}

#[cfg(unix)]
fn inode(meta: &std::fs::Metadata) -> u64 {
    std::os::unix::fs::MetadataExt::ino(meta)
}

#[cfg(not(unix))]
fn inode(_: &std::fs::Metadata) -> u64 {
    0
}

/// What one look at the files found.
#[derive(Debug)]
pub enum Look {
    /// None changed since the last look that found a change.
    Unchanged,
    /// One or more changed (or came back): read them again.
    Changed,
    /// One cannot be looked at (missing while it is replaced, say). Reported once, then
    /// quiet until it can be looked at again, which is a change.
    Unreadable(io::Error),
}

/// Files watched together (a certificate and its key; one tokens file).
#[derive(Debug)]
pub struct WatchedFiles {
    paths: Vec<PathBuf>,
    /// The files as they were at the last look (`None` when one could not be looked at).
    seen: Option<Vec<FileStamp>>,
}

impl WatchedFiles {
    /// Stamps the files now: made before they are first read, so a write that lands while
    /// they are read is a change at the next look rather than lost.
    pub fn new(paths: Vec<PathBuf>) -> Self {
        let seen = stamps(&paths).ok();
        WatchedFiles { paths, seen }
    }

    /// Looks at the files' metadata once.
    pub fn look(&mut self) -> Look {
        match stamps(&self.paths) {
            Ok(now) if self.seen.as_ref() == Some(&now) => Look::Unchanged,
            Ok(now) => {
                self.seen = Some(now);
                Look::Changed
            }
            Err(_) if self.seen.is_none() => Look::Unchanged,
            Err(e) => {
                self.seen = None;
                Look::Unreadable(e)
            }
        }
    }
}

/// What one look at watched files, and reading them again when they changed, came to.
#[derive(Debug)]
pub enum ReloadCheck<E> {
    /// The files have not changed since they were last read (or failed to be).
    Unchanged,
    /// The files changed and what was read from them is in force from now on.
    Reloaded,
    /// The files changed (or cannot be looked at) and were refused: what was read before
    /// stays in force. Reported once per change.
    Failed(E),
}

impl WatchedFiles {
    /// Looks once and, when the files changed, reads them (`read`) and puts what was read in
    /// force (`apply`); `unreadable` names the error of a file that cannot be looked at.
    pub fn reload<T, E>(
        &mut self,
        unreadable: impl FnOnce(io::Error) -> E,
        read: impl FnOnce() -> Result<T, E>,
        apply: impl FnOnce(T),
    ) -> ReloadCheck<E> {
        match self.look() {
            Look::Unchanged => ReloadCheck::Unchanged,
            Look::Unreadable(e) => ReloadCheck::Failed(unreadable(e)),
            Look::Changed => match read() {
                Ok(value) => {
                    apply(value);
                    ReloadCheck::Reloaded
                }
                Err(e) => ReloadCheck::Failed(e),
            },
        }
    }
}

fn stamps(paths: &[PathBuf]) -> io::Result<Vec<FileStamp>> {
    paths.iter().map(|p| FileStamp::of(p)).collect()
}

/// What was read last from the files, swapped whole: a reader holds the value it got for as
/// long as it needs it, and the next one gets the new value.
#[derive(Debug, Default)]
pub struct Swapped<T> {
    current: RwLock<Arc<T>>,
}

impl<T> Swapped<T> {
    pub fn new(value: T) -> Self {
        Swapped {
            current: RwLock::new(Arc::new(value)),
        }
    }

    /// The value in force now.
    pub fn current(&self) -> Arc<T> {
        // A writer cannot panic halfway through replacing an Arc, so a poisoned lock still
        // holds a whole value.
        match self.current.read() {
            Ok(guard) => guard.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    pub fn replace(&self, value: T) {
        let value = Arc::new(value);
        match self.current.write() {
            Ok(mut guard) => *guard = value,
            Err(poisoned) => *poisoned.into_inner() = value,
        }
    }
}

/// Runs `look` every [`RELOAD_CHECK_INTERVAL`] for as long as the ledger runs (until the
/// handle is aborted).
pub fn spawn_looks(mut look: impl FnMut() + Send + 'static) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(RELOAD_CHECK_INTERVAL);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            look();
        }
    })
}
