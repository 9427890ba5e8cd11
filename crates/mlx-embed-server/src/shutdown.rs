//! Shutdown triggers: a counter of shutdown requests (1 = drain, 2 = stop now).

use std::future::Future;

use tokio::sync::watch;

/// Shutdown requests so far, and the number of the last signal that made one
/// (0 when none did).
#[derive(Clone, Copy, Default)]
struct Requests {
    count: u32,
    signal: i32,
}

/// Counts shutdown requests; `serve` drains on the first and gives up waiting on the second.
/// A launcher makes one with [`Trigger::from_signals`] before it loads its
/// models, so a signal that comes during a load of minutes is not lost, and
/// hands it to [`crate::serve_models_with`].
#[derive(Clone)]
pub struct Trigger(watch::Receiver<Requests>);

impl Trigger {
    /// Waits until at least `n` shutdown requests arrived (forever if none can come).
    pub async fn reached(&mut self, n: u32) {
        if self.0.wait_for(|r| r.count >= n).await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// The number of the last signal that asked for a shutdown, if one did
    /// (a launcher that stops before serving exits with 128 plus it, as a
    /// shell reports a process a signal ended).
    pub fn last_signal(&self) -> Option<i32> {
        let signal = self.0.borrow().signal;
        (signal != 0).then_some(signal)
    }

    /// One request, when `fut` completes.
    pub fn from_future(fut: impl Future<Output = ()> + Send + 'static) -> Self {
        let (tx, rx) = watch::channel(Requests::default());
        tokio::spawn(async move {
            fut.await;
            let _ = tx.send(Requests {
                count: 1,
                signal: 0,
            });
            // Keep the sender so "no more requests" reads as pending, not closed.
            tx.closed().await;
        });
        Trigger(rx)
    }

    /// One request per SIGINT, SIGTERM or SIGHUP (a closed terminal, or a
    /// reload the server has no use for: it drains rather than dying at once
    /// with requests in flight). Installs the handlers now, so a failure
    /// shows at start; needs a tokio runtime.
    pub fn from_signals() -> std::io::Result<Self> {
        let (tx, rx) = watch::channel(Requests::default());
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            let mut term = signal(SignalKind::terminate())?;
            let mut int = signal(SignalKind::interrupt())?;
            let mut hup = signal(SignalKind::hangup())?;
            tokio::spawn(async move {
                loop {
                    let (name, number) = tokio::select! {
                        _ = term.recv() => ("SIGTERM", libc::SIGTERM),
                        _ = int.recv() => ("SIGINT", libc::SIGINT),
                        _ = hup.recv() => ("SIGHUP", libc::SIGHUP),
                    };
                    let count = tx.borrow().count + 1;
                    tracing::info!(signal = name, "received {name}");
                    if tx
                        .send(Requests {
                            count,
                            signal: number,
                        })
                        .is_err()
                    {
                        break;
                    }
                }
            });
        }
        #[cfg(not(unix))]
        {
            tokio::spawn(async move {
                while tokio::signal::ctrl_c().await.is_ok() {
                    let count = tx.borrow().count + 1;
                    // Windows' Ctrl-C is SIGINT's number in its C runtime too.
                    if tx.send(Requests { count, signal: 2 }).is_err() {
                        break;
                    }
                }
            });
        }
        Ok(Trigger(rx))
    }
}
