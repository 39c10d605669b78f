//! A TCP proxy in front of PostgreSQL that a test can switch into a fault: refuse new
//! connections and cut the open ones, accept connections and never answer (a black hole), or
//! let the open connections go silent while new ones pass (a network that dropped them).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::AbortHandle;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Forward everything.
    Pass,
    /// Close the port (connection refused) and cut every open connection.
    Refuse,
    /// Accept and hold connections without forwarding a byte; cut the open ones.
    Blackhole,
    /// The connections open at the switch stop passing bytes in either direction and are never
    /// closed, as when a NAT or firewall loses their state or the server's address moves: no FIN,
    /// no RST, nothing for the client to notice but silence. New connections pass, and stay
    /// frozen when the mode goes back to `Pass`.
    Freeze,
}

pub struct FaultProxy {
    pub port: u16,
    mode: watch::Sender<Mode>,
}

impl FaultProxy {
    /// Starts a proxy on a free port forwarding to `target`.
    pub async fn start(target: SocketAddr) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (mode, rx) = watch::channel(Mode::Pass);
        tokio::spawn(run(listener, port, target, rx));
        FaultProxy { port, mode }
    }

    pub fn set(&self, mode: Mode) {
        self.mode.send_replace(mode);
    }
}

async fn run(listener: TcpListener, port: u16, target: SocketAddr, mut mode: watch::Receiver<Mode>) {
    let live: Arc<Mutex<Vec<AbortHandle>>> = Arc::default();
    let mut listener = Some(listener);
    loop {
        let current = *mode.borrow_and_update();
        if matches!(current, Mode::Refuse | Mode::Blackhole) {
            for conn in live.lock().unwrap().drain(..) {
                conn.abort();
            }
        }
        if current == Mode::Refuse {
            listener = None;
        } else if listener.is_none() {
            // Re-open the same port (SO_REUSEADDR is set by tokio on Unix).
            loop {
                match TcpListener::bind(("127.0.0.1", port)).await {
                    Ok(l) => break listener = Some(l),
                    Err(_) => tokio::time::sleep(std::time::Duration::from_millis(20)).await,
                }
            }
        }
        let Some(l) = listener.as_ref() else {
            if mode.changed().await.is_err() {
                return;
            }
            continue;
        };
        tokio::select! {
            changed = mode.changed() => if changed.is_err() { return },
            accepted = l.accept() => {
                let Ok((client, _)) = accepted else { continue };
                let task = match current {
                    Mode::Pass | Mode::Freeze => {
                        let mut freeze = mode.clone();
                        freeze.mark_unchanged();
                        tokio::spawn(forward(client, target, freeze))
                    }
                    Mode::Refuse | Mode::Blackhole => tokio::spawn(async move {
                        let _held = client;
                        std::future::pending::<()>().await;
                    }),
                };
                let mut live = live.lock().unwrap();
                live.retain(|t| !t.is_finished());
                live.push(task.abort_handle());
            }
        }
    }
}

/// Forwards until either side closes, or until the mode next changes to `Freeze`: then both
/// sockets are held open and nothing more passes.
async fn forward(mut client: TcpStream, target: SocketAddr, mut mode: watch::Receiver<Mode>) {
    let Ok(mut server) = TcpStream::connect(target).await else { return };
    let frozen = async {
        loop {
            if mode.changed().await.is_err() {
                return std::future::pending::<()>().await;
            }
            if *mode.borrow_and_update() == Mode::Freeze {
                return;
            }
        }
    };
    tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
        () = frozen => std::future::pending::<()>().await,
    }
}

/// The address of the PostgreSQL server in `DATABASE_URL`.
pub fn postgres_addr() -> SocketAddr {
    let config = crate::db::admin_config();
    let host = match &config.get_hosts()[0] {
        tokio_postgres::config::Host::Tcp(h) => h.clone(),
        #[allow(unreachable_patterns)]
        _ => panic!("the tests need DATABASE_URL over TCP"),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let host = if host == "localhost" { "127.0.0.1".to_owned() } else { host };
    format!("{host}:{port}").parse().expect("DATABASE_URL host must be an IP address or localhost")
}
