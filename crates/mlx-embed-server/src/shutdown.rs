//! Shutdown triggers: a counter of shutdown requests (1 = drain, 2 = stop now).

use std::future::Future;

use tokio::sync::watch;

/// Counts shutdown requests; `serve` drains on the first and gives up waiting on the second.
#[derive(Clone)]
pub(crate) struct Trigger(watch::Receiver<u32>);

impl Trigger {
    /// Waits until at least `n` shutdown requests arrived (forever if none can come).
    pub async fn reached(&mut self, n: u32) {
        if self.0.wait_for(|&c| c >= n).await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// One request, when `fut` completes.
    pub fn from_future(fut: impl Future<Output = ()> + Send + 'static) -> Self {
        let (tx, rx) = watch::channel(0);
        tokio::spawn(async move {
            fut.await;
            let _ = tx.send(1);
            // Keep the sender so "no more requests" reads as pending, not closed.
            tx.closed().await;
        });
        Trigger(rx)
    }

    /// One request per SIGINT or SIGTERM. Installs the handlers now, so a failure shows at start.
    pub fn from_signals() -> std::io::Result<Self> {
        let (tx, rx) = watch::channel(0);
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            let mut term = signal(SignalKind::terminate())?;
            let mut int = signal(SignalKind::interrupt())?;
            tokio::spawn(async move {
                loop {
                    let name = tokio::select! {
                        _ = term.recv() => "SIGTERM",
                        _ = int.recv() => "SIGINT",
                    };
                    let n = *tx.borrow() + 1;
                    tracing::info!(signal = name, "received {name}");
                    if tx.send(n).is_err() {
                        break;
                    }
                }
            });
        }
        #[cfg(not(unix))]
        {
            tokio::spawn(async move {
                while tokio::signal::ctrl_c().await.is_ok() {
                    let n = *tx.borrow() + 1;
                    if tx.send(n).is_err() {
                        break;
                    }
                }
            });
        }
        Ok(Trigger(rx))
    }
}
