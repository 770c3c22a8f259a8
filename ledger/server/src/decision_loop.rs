//! The decision loop: one thread that reads the filter's requests (`/v1/authorize`,
//! `/v1/outcomes`, `/v1/limits`), decides them and commits them (docs/design.md#the-ledgers-hot-path).
//!
//! Its runtime has one thread. The service listener, every connection and stream on it, and
//! the store's writer (SQLite) or the workers and connections that decide (PostgreSQL) are
//! tasks of that runtime: a request goes from its socket to its commit and back without being
//! handed to another thread. Each turn the writer takes every request the turn read, decides
//! them in one transaction and commits once, with its `fdatasync` inline, so the requests
//! that arrive during one sync share the next. The admin API, the inbox, the sweeper, the
//! reconciler and `/metrics` run on the ledger's other runtime and hand their writes to the
//! loop.

use std::future::Future;
use std::pin::Pin;
use std::thread::JoinHandle;

use tokio::sync::oneshot;

/// What the loop serves once the ledger is ready to listen: a future made on the loop's own
/// thread, so every task it spawns is the loop's.
type Serve = Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = ()>>> + Send>;

pub struct DecisionLoop {
    handle: tokio::runtime::Handle,
    serve: Option<oneshot::Sender<Serve>>,
    thread: Option<JoinHandle<()>>,
}

impl DecisionLoop {
    /// Starts the loop's thread. Until [`DecisionLoop::serve`] gives it a listener it runs the
    /// tasks given to it already (the store's writer, whose migrations and signing key the
    /// ledger writes before it listens).
    pub fn start() -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let handle = runtime.handle().clone();
        let (serve, served) = oneshot::channel::<Serve>();
        let thread = std::thread::Builder::new()
            .name("atmost-decide".into())
            .spawn(move || {
                runtime.block_on(async move {
                    // An error: the ledger stopped before it listened.
                    if let Ok(make) = served.await {
                        make().await;
                    }
                })
            })?;
        Ok(DecisionLoop {
            handle,
            serve: Some(serve),
            thread: Some(thread),
        })
    }

    /// The loop's runtime, for the tasks that must run on its thread (the store's writer).
    pub fn handle(&self) -> &tokio::runtime::Handle {
        &self.handle
    }

    /// Has the loop's thread make and run `make()`; resolves with its result. `make` runs on
    /// the loop's thread, so the listener it binds and every task it spawns are the loop's.
    pub fn serve<F, Fut>(&mut self, make: F) -> impl Future<Output = std::io::Result<()>> + Send
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = std::io::Result<()>> + 'static,
    {
        let (done, finished) = oneshot::channel();
        let sent = self.serve.take().map(|serve| {
            serve.send(Box::new(move || {
                Box::pin(async move {
                    let _ = done.send(make().await);
                })
            }))
        });
        async move {
            match sent {
                Some(Ok(())) => finished
                    .await
                    .unwrap_or_else(|_| Err(std::io::Error::other("the decision loop stopped"))),
                _ => Err(std::io::Error::other(
                    "the decision loop is not running (it serves once)",
                )),
            }
        }
    }

    /// Waits for the loop's thread to end (it ends when what it served returns).
    pub fn join(mut self) -> std::io::Result<()> {
        // A loop that never got a listener ends when it learns it never will.
        drop(self.serve.take());
        match self.thread.take().map(JoinHandle::join) {
            Some(Err(_)) => Err(std::io::Error::other("the decision loop's thread panicked")),
            _ => Ok(()),
        }
    }
}
