//! A PostgreSQL cluster of its own that takes TCP connections over TLS only (`hostssl` in
//! `pg_hba.conf`), with certificates made at start: a CA and a server certificate it signs for
//! `localhost`, another CA that signs nothing of this server, a client certificate for the
//! role `inbox_cert`, which may log in by certificate only, and role `inbox_pw`, which logs in
//! with a password (SCRAM) only.
//!
//! Needs `initdb`, `pg_ctl`, `psql` and `openssl` on PATH; as root, the server runs as the
//! `postgres` user, as `scripts/pg.sh` runs the shared cluster.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::server_user::{as_server, run, running_as_root, write_as_server};

static NEXT: AtomicUsize = AtomicUsize::new(0);

/// The password role `inbox_pw` is created with.
pub const PASSWORD: &str = "first-Secret?&@:/";

/// A running TLS-only cluster, stopped and deleted when dropped.
pub struct TlsCluster {
    dir: PathBuf,
    pub port: u16,
    /// The CA that signed the server's certificate (PEM).
    pub ca: PathBuf,
    /// A CA that signed nothing of this server (PEM).
    pub other_ca: PathBuf,
    /// The client certificate and key of role `inbox_cert` (PEM), signed by [`TlsCluster::ca`].
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

fn openssl(dir: &Path, args: &[&str]) {
    let mut cmd = Command::new("openssl");
    cmd.current_dir(dir).args(args);
    run(cmd, &format!("openssl {}", args.join(" ")));
}

/// A P-256 key and a certificate for `subject`: self-signed (a CA) or signed by `ca` with
/// `extensions` (an openssl extension section's lines).
fn certificate(dir: &Path, name: &str, subject: &str, ca: Option<&str>, extensions: &str) {
    let key = format!("{name}.key");
    let pem = format!("{name}.pem");
    openssl(dir, &["ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", &key]);
    // PKCS#8, the form every client library reads.
    openssl(dir, &["pkcs8", "-topk8", "-nocrypt", "-in", &key, "-out", &format!("{name}.p8")]);
    std::fs::rename(dir.join(format!("{name}.p8")), dir.join(&key)).unwrap();
    match ca {
        None => openssl(
            dir,
            &[
                "req",
                "-x509",
                "-new",
                "-key",
                &key,
                "-out",
                &pem,
                "-days",
                "2",
                "-subj",
                subject,
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign,cRLSign",
            ],
        ),
        Some(ca) => {
            let csr = format!("{name}.csr");
            let ext = format!("{name}.ext");
            std::fs::write(dir.join(&ext), extensions).unwrap();
            openssl(dir, &["req", "-new", "-key", &key, "-out", &csr, "-subj", subject]);
            openssl(
                dir,
                &[
                    "x509",
                    "-req",
                    "-in",
                    &csr,
                    "-CA",
                    &format!("{ca}.pem"),
                    "-CAkey",
                    &format!("{ca}.key"),
                    "-CAcreateserial",
                    "-out",
                    &pem,
                    "-days",
                    "2",
                    "-extfile",
                    &ext,
                ],
            );
        }
    }
}

impl TlsCluster {
    /// Makes the certificates, creates and starts the cluster, and creates database `inbox` and
    /// role `inbox_cert` (superuser, certificate login only). Blocking: call it off the runtime.
    pub fn start() -> TlsCluster {
        let dir = std::env::temp_dir().join(format!(
            "inbox-tls-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        certificate(&dir, "ca", "/CN=stripe-inbox test CA", None, "");
        certificate(&dir, "other-ca", "/CN=another test CA", None, "");
        certificate(
            &dir,
            "server",
            "/CN=localhost",
            Some("ca"),
            "subjectAltName=DNS:localhost\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n",
        );
        certificate(
            &dir,
            "client",
            "/CN=inbox_cert",
            Some("ca"),
            "extendedKeyUsage=clientAuth\nbasicConstraints=CA:FALSE\n",
        );
        let port = crate::port::free();
        let data = dir.join("data");
        if running_as_root() {
            let mut chown = Command::new("chown");
            chown.args(["-R", "postgres:postgres"]).arg(&dir);
            run(chown, "chown");
        }
        let mut initdb = as_server("initdb");
        initdb.arg("-D").arg(&data).args(["-U", "postgres", "-E", "UTF8", "--locale=C", "--auth=trust"]);
        run(initdb, "initdb");
        let conf = format!(
            "listen_addresses = '127.0.0.1'\nport = {port}\nunix_socket_directories = '{dir}'\n\
             ssl = on\nssl_cert_file = '{dir}/server.pem'\nssl_key_file = '{dir}/server.key'\n\
             ssl_ca_file = '{dir}/ca.pem'\nfsync = off\nmax_connections = 40\n",
            dir = dir.display()
        );
        let hba = "local all all trust\n\
                   hostssl all inbox_cert 127.0.0.1/32 cert\n\
                   hostssl all inbox_pw 127.0.0.1/32 scram-sha-256\n\
                   hostssl all all 127.0.0.1/32 trust\n";
        // Written by the server's user: the files are in its directory.
        for (file, text) in [("postgresql.auto.conf", conf.as_str()), ("pg_hba.conf", hba)] {
            write_as_server(&data.join(file), text, false);
        }
        let mut chmod = as_server("chmod");
        chmod.arg("600").arg(dir.join("server.key"));
        run(chmod, "chmod server.key");
        let mut start = as_server("pg_ctl");
        start.arg("-D").arg(&data).arg("-l").arg(dir.join("postgres.log")).args(["-w", "-t", "60", "start"]);
        run(start, "pg_ctl start");
        let mut psql = Command::new("psql");
        psql.args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-h"])
            .arg(&dir)
            .args(["-p", &port.to_string()])
            .args([
                "-U",
                "postgres",
                "-d",
                "postgres",
                "-c",
                "CREATE DATABASE inbox",
                "-c",
                "CREATE ROLE inbox_cert SUPERUSER LOGIN",
                "-c",
                &format!("CREATE ROLE inbox_pw SUPERUSER LOGIN PASSWORD '{PASSWORD}'"),
            ]);
        run(psql, "psql");
        TlsCluster {
            ca: dir.join("ca.pem"),
            other_ca: dir.join("other-ca.pem"),
            client_cert: dir.join("client.pem"),
            client_key: dir.join("client.key"),
            dir,
            port,
        }
    }

    /// Runs `sql` on database `inbox` as the superuser, over the cluster's Unix socket; returns
    /// what psql printed (unaligned, tuples only).
    pub fn psql(&self, sql: &str) -> String {
        let output = Command::new("psql")
            .args(["-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-h"])
            .arg(&self.dir)
            .args(["-p", &self.port.to_string(), "-U", "postgres", "-d", "inbox", "-c", sql])
            .output()
            .expect("psql");
        assert!(output.status.success(), "psql {sql}: {}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8_lossy(&output.stdout).trim().to_owned()
    }

    /// `postgres://{user}@{host}:{port}/inbox?{params}`. `host` is what the certificate is checked
    /// against; the connection goes to 127.0.0.1 whatever it is (`hostaddr`).
    pub fn url(&self, user: &str, host: &str, params: &str) -> String {
        format!("postgres://{user}@{host}:{}/inbox?hostaddr=127.0.0.1&{params}", self.port)
    }
}

impl Drop for TlsCluster {
    fn drop(&mut self) {
        let mut stop = as_server("pg_ctl");
        stop.arg("-D").arg(self.dir.join("data")).args(["-m", "immediate", "-w", "stop"]);
        let _ = stop.output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
