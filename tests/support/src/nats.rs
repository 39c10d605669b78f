//! Debian's `nats-server` with JetStream, as the relay's tests and the chaos run use it: one
//! server, or a three-node cluster, each node on its own localhost ports and store directory, so
//! a node can be SIGKILLed and brought back on the same port with what it had stored. Plus the
//! two things the tests ask JetStream: create a stream (retried while the cluster elects its
//! leaders) and read back every message it stores.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use async_nats::jetstream;

/// Where nats-server is installed, if it is (Debian puts it in /usr/sbin).
pub fn binary() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|paths| std::env::split_paths(&paths).collect::<Vec<_>>())
        .map(|dir| dir.join("nats-server"));
    on_path.chain([PathBuf::from("/usr/sbin/nats-server")]).find(|p| p.is_file())
}

/// One nats-server process: its configuration file stays, so it restarts as itself.
struct Node {
    config: PathBuf,
    log: PathBuf,
    port: u16,
    child: Option<Child>,
}

impl Node {
    fn start(&mut self, binary: &Path) {
        assert!(self.child.is_none(), "node already running");
        let child = Command::new(binary)
            .arg("-c")
            .arg(&self.config)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting nats-server");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(15);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "nats-server did not listen on {}: {}",
                self.port,
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A running nats-server, or cluster of them, with JetStream; stopped and removed when dropped.
pub struct Nats {
    binary: PathBuf,
    dir: PathBuf,
    nodes: Vec<Node>,
}

impl Nats {
    /// One server with JetStream. None when nats-server is not installed. Blocking.
    pub fn single() -> Option<Nats> {
        Nats::start(1)
    }

    /// A cluster of `n` servers (three for an R3 stream) routed to each other, JetStream on each.
    /// None when nats-server is not installed. Blocking.
    pub fn cluster(n: usize) -> Option<Nats> {
        Nats::start(n)
    }

    fn start(n: usize) -> Option<Nats> {
        let binary = binary()?;
        let dir = std::env::temp_dir().join(format!(
            "inbox-nats-{}-{}",
            std::process::id(),
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let ports: Vec<(u16, u16)> = (0..n).map(|_| (crate::port::free(), crate::port::free())).collect();
        let mut nodes = Vec::new();
        for (i, (port, route)) in ports.iter().enumerate() {
            let store = dir.join(format!("n{i}"));
            let log = dir.join(format!("n{i}.log"));
            let mut config = format!(
                "server_name: n{i}\nlisten: 127.0.0.1:{port}\nlog_file: \"{}\"\n\
                 jetstream {{\n  store_dir: \"{}\"\n  max_memory_store: 64MB\n  max_file_store: 1GB\n}}\n",
                log.display(),
                store.display()
            );
            if n > 1 {
                let routes: Vec<String> = ports
                    .iter()
                    .enumerate()
                    .filter(|(j, _)| *j != i)
                    .map(|(_, (_, r))| format!("nats-route://127.0.0.1:{r}"))
                    .collect();
                config.push_str(&format!(
                    "cluster {{\n  name: inbox\n  listen: 127.0.0.1:{route}\n  routes: [{}]\n}}\n",
                    routes.join(", ")
                ));
            }
            let path = dir.join(format!("n{i}.conf"));
            std::fs::write(&path, config).unwrap();
            nodes.push(Node { config: path, log, port: *port, child: None });
        }
        for node in &mut nodes {
            node.start(&binary);
        }
        Some(Nats { binary, dir, nodes })
    }

    /// Every node's client URL, comma-separated (what `relay --to-nats` takes).
    pub fn urls(&self) -> String {
        self.nodes.iter().map(|n| format!("nats://127.0.0.1:{}", n.port)).collect::<Vec<_>>().join(",")
    }

    /// Node `i`'s name in the cluster (`n0`, `n1`, …), as stream info names its leader.
    pub fn name(&self, i: usize) -> String {
        format!("n{i}")
    }

    /// SIGKILLs node `i`: no shutdown, what it had written stays in its store.
    pub fn kill(&mut self, i: usize) {
        self.nodes[i].kill();
    }

    /// Starts node `i` again on its port and store.
    pub fn start_node(&mut self, i: usize) {
        let binary = self.binary.clone();
        self.nodes[i].start(&binary);
    }

    /// The logs of every node, for failure messages.
    pub fn logs(&self) -> String {
        self.nodes
            .iter()
            .enumerate()
            .map(|(i, n)| format!("--- n{i}\n{}", std::fs::read_to_string(&n.log).unwrap_or_default()))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            node.kill();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A JetStream context on `urls` (comma-separated), reconnecting to whichever node is up.
pub async fn jetstream(urls: &str) -> jetstream::Context {
    let addrs: Vec<async_nats::ServerAddr> = urls.split(',').map(|u| u.parse().unwrap()).collect();
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect(addrs)
        .await
        .expect("connecting to NATS");
    jetstream::context::ContextBuilder::new().timeout(Duration::from_secs(5)).build(client)
}

/// Creates stream `name` capturing `subject` with `replicas` copies and JetStream's default
/// duplicate window (2 minutes), retrying while a fresh cluster has no meta leader yet.
pub async fn create_stream(js: &jetstream::Context, name: &str, subject: &str, replicas: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let config = jetstream::stream::Config {
            name: name.to_owned(),
            subjects: vec![subject.to_owned()],
            num_replicas: replicas,
            ..Default::default()
        };
        match js.get_or_create_stream(config).await {
            Ok(_) => return,
            Err(e) if Instant::now() < deadline => {
                eprintln!("creating stream {name}: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Err(e) => panic!("creating stream {name}: {e}"),
        }
    }
}

/// A message the stream stores: its sequence, `Nats-Msg-Id`, fencing token, aggregate and payload.
#[derive(Debug, Clone)]
pub struct Stored {
    pub sequence: u64,
    pub msg_id: String,
    pub fencing_token: i64,
    pub aggregate_id: String,
    pub payload: Vec<u8>,
}

/// Every message stream `name` stores, in sequence order, read from its leader (retried while
/// the stream has none).
pub async fn stored(js: &jetstream::Context, name: &str) -> Vec<Stored> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut stream = loop {
        match js.get_stream(name).await {
            Ok(stream) => break stream,
            Err(e) if Instant::now() < deadline => {
                eprintln!("reading stream {name}: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Err(e) => panic!("reading stream {name}: {e}"),
        }
    };
    // The state now, not when the stream was looked up.
    let state = stream.info().await.expect("stream info").state.clone();
    let mut messages = Vec::with_capacity(state.messages as usize);
    for sequence in state.first_sequence..=state.last_sequence {
        if state.messages == 0 {
            break;
        }
        let message = loop {
            match stream.get_raw_message(sequence).await {
                Ok(message) => break message,
                Err(e) if Instant::now() < deadline => {
                    eprintln!("reading message {sequence} of {name}: {e}; retrying");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("reading message {sequence} of {name}: {e}"),
            }
        };
        let header =
            |name: &str| message.headers.get(name).map(|v| v.as_str().to_owned()).unwrap_or_default();
        messages.push(Stored {
            sequence,
            msg_id: header("Nats-Msg-Id"),
            fencing_token: header("inbox-fencing-token").parse().unwrap_or(-1),
            aggregate_id: header("inbox-aggregate-id"),
            payload: message.payload.to_vec(),
        });
    }
    messages
}
