//! Schedulers and workers run in the test's own process through their crates' `serve`, as
//! mini-redis's tests call its `run`: for the tests that kill nothing, no binary is started.
//!
//! Each server gets a Tokio runtime of its own on a thread of its own, so its tasks never share the
//! test's runtime and dropping it stops everything it started, as a SIGKILL stops a process: the
//! runtime is shut down (a blocking task gets a second to end) and the server's broker connections
//! close with it. Its logs go to the test's captured output (shown when the test fails), with the
//! filter the child processes get.

use std::future::Future;
use std::sync::Once;
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::Context;
use tokio_util::sync::CancellationToken;

/// What a child process's `RUST_LOG` is (see `Farm`'s environment).
pub(crate) const LOG_FILTER: &str = "info,lapin=warn,lapin::returned_messages=error,aws=warn";

/// A scheduler or worker running in this process until dropped.
pub(crate) struct InProcess {
    kill: CancellationToken,
    thread: Option<JoinHandle<()>>,
}

impl InProcess {
    pub(crate) fn scheduler(config: vnfarm_scheduler::Config) -> anyhow::Result<Self> {
        let listener = bind(config.listen)?;
        Self::start("scheduler", listener, move |listener, shutdown| {
            vnfarm_scheduler::serve(config, listener, shutdown)
        })
    }

    pub(crate) fn worker(config: vnfarm_worker::Config) -> anyhow::Result<Self> {
        let listener = bind(config.listen)?;
        Self::start("worker", listener, move |listener, shutdown| {
            vnfarm_worker::serve(config, listener, shutdown)
        })
    }

    fn start<F, Fut>(name: &str, listener: std::net::TcpListener, serve: F) -> anyhow::Result<Self>
    where
        F: FnOnce(tokio::net::TcpListener, CancellationToken) -> Fut + Send + 'static,
        Fut: Future<Output = anyhow::Result<()>>,
    {
        init_logs();
        let kill = CancellationToken::new();
        let killed = kill.clone();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name(format!("{name}-runtime"))
            .build()
            .context("a runtime for an in-process server")?;
        let name = name.to_owned();
        let thread = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || {
                runtime.block_on(async move {
                    let listener = match tokio::net::TcpListener::from_std(listener) {
                        Ok(listener) => listener,
                        Err(e) => return eprintln!("in-process {name}: its listener: {e}"),
                    };
                    // The shutdown token stays uncancelled: the tests that drain a server by its
                    // signal run the binaries.
                    tokio::select! {
                        result = serve(listener, CancellationToken::new()) => {
                            if let Err(e) = result {
                                eprintln!("in-process {name} stopped: {e:#}");
                            }
                        }
                        () = killed.cancelled() => {}
                    }
                });
                runtime.shutdown_timeout(Duration::from_secs(1));
            })
            .context("a thread for an in-process server")?;
        Ok(Self {
            kill,
            thread: Some(thread),
        })
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        self.kill.cancel();
        if let Some(thread) = self.thread.take() {
            // A panic in the server already failed the test through its message.
            let _ = thread.join();
        }
    }
}

fn bind(address: std::net::SocketAddr) -> anyhow::Result<std::net::TcpListener> {
    let listener =
        std::net::TcpListener::bind(address).with_context(|| format!("binding {address}"))?;
    // Tokio takes over a listener only in non-blocking mode.
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// Installs the process's log subscriber once: each test's servers log into that test's captured
/// output, since threads inherit the capture of the thread that spawned them.
fn init_logs() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // Another subscriber set first (none is, in these binaries) would keep logging; nothing to do.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(LOG_FILTER))
            .with_test_writer()
            .try_init();
    });
}
