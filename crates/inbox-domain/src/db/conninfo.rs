//! `DATABASE_URL` read as libpq reads a connection string, and the libpq environment.
//!
//! tokio-postgres parses connection strings too, but not as libpq does: it knows only
//! `sslmode=disable|prefer|require`, refuses `verify-ca`, `verify-full`, `sslrootcert`, `sslcert`,
//! `sslkey`, `gssencmode` and `passfile`, reads no `PG*` variable and no `~/.pgpass`, and takes a
//! URL's credentials up to the first `@` anywhere in the string. So the string is parsed here,
//! with libpq's rules (a URL's query starts after the authority and the path, never inside a
//! password), the `PG*` variables fill what it leaves out, and the driver's [`Config`] is built
//! from the result. The driver's own reading of the same string is then compared with ours: where
//! the two would connect differently (another host, user, password or database), the string is
//! refused, naming the setting, rather than one of them silently winning.
//!
//! Decisions where this departs from libpq:
//! - `DATABASE_PASSWORD_FILE` (ours): a file holding the password, read again for every new
//!   connection, for credentials rotated under a running process (Kubernetes secrets, short-lived
//!   cloud tokens a sidecar writes). A password in the string as well is refused as ambiguous.
//! - Without `sslrootcert`, `sslmode=verify-full` trusts the operating system's CA store when
//!   `~/.postgresql/root.crt` does not exist (libpq fails): what a managed server with a public
//!   certificate needs. `verify-ca` and `require` never trust the system's store, given or implied
//!   (a publicly trusted certificate for any name would pass them), as libpq 16 refuses it.
//! - `gssencmode`: no GSSAPI here, so `prefer` connects without it and `require` is refused.
//! - No `user` anywhere: `$USER` (libpq asks the system for the process's user name).
//! - `tcp_user_timeout` is milliseconds, as libpq says (the driver's own parser reads seconds).
//!
//! No error repeats the string or a value from it: a malformed string may carry its password
//! anywhere. Errors name the setting, or the position of an entry.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio_postgres::config::{ChannelBinding, LoadBalanceHosts, TargetSessionAttrs};
use tokio_postgres::Config;

/// libpq's `sslmode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    /// No TLS.
    Disable,
    /// libpq tries without TLS first; here it behaves as `prefer` (TLS when the server offers it).
    Allow,
    /// TLS when the server offers it, without checking its certificate; else in clear.
    Prefer,
    /// TLS, without checking the certificate (unless a CA file is given or `~/.postgresql/root.crt`
    /// exists: then as `verify-ca`, as libpq does).
    Require,
    /// TLS, the certificate signed by a CA of `sslrootcert`.
    VerifyCa,
    /// TLS, the certificate signed by a trusted CA and issued for the host connected to.
    VerifyFull,
}

impl SslMode {
    fn parse(value: &str) -> anyhow::Result<Self> {
        Ok(match value {
            "disable" => SslMode::Disable,
            "allow" => SslMode::Allow,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            _ => {
                anyhow::bail!("sslmode is not one of disable, allow, prefer, require, verify-ca, verify-full")
            }
        })
    }

    /// The name libpq gives it.
    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Allow => "allow",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }

    /// What tokio-postgres must do on the wire; certificate checks are rustls'.
    pub(crate) fn wire(self) -> tokio_postgres::config::SslMode {
        use tokio_postgres::config::SslMode as Wire;
        match self {
            SslMode::Disable => Wire::Disable,
            SslMode::Allow | SslMode::Prefer => Wire::Prefer,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => Wire::Require,
        }
    }
}

/// Where the CA certificates that sign the server's certificate come from (`sslrootcert`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RootCerts {
    /// `sslrootcert=system`: the operating system's CA store. Only with `verify-full`.
    System,
    /// `sslrootcert=PATH` (or libpq's default `~/.postgresql/root.crt`): the PEM certificates in
    /// that file.
    File(PathBuf),
}

/// The TLS settings of a connection, resolved: what [`super::tls::connector`] builds from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsSettings {
    pub mode: SslMode,
    /// The CAs the server's certificate must chain to; None: the certificate is not checked
    /// (`prefer`, `require`).
    pub root_certs: Option<RootCerts>,
    /// `sslcert` and `sslkey`: a client certificate (PEM chain) and its unencrypted PEM key.
    pub client_cert: Option<(PathBuf, PathBuf)>,
}

impl Default for TlsSettings {
    /// libpq's default: `sslmode=prefer`, nothing checked.
    fn default() -> Self {
        TlsSettings { mode: SslMode::Prefer, root_certs: None, client_cert: None }
    }
}

/// Where the password of a new connection comes from when it is not fixed in the settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PasswordSource {
    /// In the string or `PGPASSWORD` (already in the driver's settings), or none at all.
    Fixed,
    /// `DATABASE_PASSWORD_FILE`: the whole file (less one trailing line break), read again for
    /// every new connection.
    File(PathBuf),
    /// A password file in `~/.pgpass` format (`passfile`, `PGPASSFILE`, or `~/.pgpass`), looked up
    /// for every new connection by host, port, database and user, as libpq does.
    Pgpass(PathBuf),
}

/// A connection string resolved against the environment: everything needed to connect.
#[derive(Debug, Clone)]
pub struct ConnInfo {
    /// Host, port, user, database, options…; the password when it is fixed.
    pub config: Config,
    pub tls: TlsSettings,
    pub password: PasswordSource,
    /// Whether the settings named an `application_name` (the string or `PGAPPNAME`): the
    /// component's own name is then not put in its place.
    pub application_name_given: bool,
    /// Whether the settings named `keepalives` or `keepalives_idle`: the pools' own (on, a
    /// shorter idle time) are then not put in their place.
    pub keepalives_given: bool,
    /// What the caller should log once logging is up (an insecure password file ignored, …).
    pub warnings: Vec<String>,
}

/// The environment variables read, by name: the process's own, or a map in tests.
pub trait Environment {
    fn var(&self, name: &str) -> Option<String>;
}

/// The process's environment.
pub struct ProcessEnvironment;

impl Environment for ProcessEnvironment {
    fn var(&self, name: &str) -> Option<String> {
        std::env::var(name).ok()
    }
}

impl<const N: usize> Environment for [(&str, &str); N] {
    fn var(&self, name: &str) -> Option<String> {
        self.iter().find(|(k, _)| *k == name).map(|(_, v)| (*v).to_owned())
    }
}

/// The libpq keywords read, and the environment variable that fills each when the string does
/// not set it.
const KEYWORDS: &[(&str, Option<&str>)] = &[
    ("host", Some("PGHOST")),
    ("hostaddr", Some("PGHOSTADDR")),
    ("port", Some("PGPORT")),
    ("dbname", Some("PGDATABASE")),
    ("user", Some("PGUSER")),
    ("password", Some("PGPASSWORD")),
    ("passfile", Some("PGPASSFILE")),
    ("options", Some("PGOPTIONS")),
    ("application_name", Some("PGAPPNAME")),
    ("fallback_application_name", None),
    ("connect_timeout", Some("PGCONNECT_TIMEOUT")),
    ("sslmode", Some("PGSSLMODE")),
    ("sslrootcert", Some("PGSSLROOTCERT")),
    ("sslcert", Some("PGSSLCERT")),
    ("sslkey", Some("PGSSLKEY")),
    ("gssencmode", Some("PGGSSENCMODE")),
    ("target_session_attrs", Some("PGTARGETSESSIONATTRS")),
    ("channel_binding", Some("PGCHANNELBINDING")),
    ("load_balance_hosts", Some("PGLOADBALANCEHOSTS")),
    ("keepalives", None),
    ("keepalives_idle", None),
    ("keepalives_interval", None),
    ("keepalives_count", None),
    ("tcp_user_timeout", None),
    // Accepted and without effect here, as they are for a libpq built without the feature.
    ("krbsrvname", Some("PGKRBSRVNAME")),
    ("gsslib", Some("PGGSSLIB")),
    ("sslcompression", None),
    ("sslsni", None),
];

/// libpq keywords refused by name, with the reason.
const REFUSED: &[(&str, &str)] = &[
    ("sslpassword", "sslpassword is not supported: the client key must be an unencrypted PEM file"),
    ("sslcrl", "sslcrl is not supported: certificate revocation lists are not read"),
    ("sslcrldir", "sslcrldir is not supported: certificate revocation lists are not read"),
    ("service", "service is not supported: pg_service.conf is not read; put the settings in DATABASE_URL"),
    ("requirepeer", "requirepeer is not supported"),
    (
        "ssl_min_protocol_version",
        "ssl_min_protocol_version is not supported: TLS 1.2 or later is always required",
    ),
    ("ssl_max_protocol_version", "ssl_max_protocol_version is not supported"),
    ("client_encoding", "client_encoding is not supported: the connection is always UTF8"),
    ("replication", "replication is not supported"),
];

/// The environment variable naming a password file read for every new connection (ours).
pub const PASSWORD_FILE_ENV: &str = "DATABASE_PASSWORD_FILE";

/// A connection string's settings as written: keyword and value, in order (a later one wins).
type Params = Vec<(String, String)>;

/// Reads `text` (a URL or libpq's key=value form) with libpq's rules, fills what it leaves out
/// from `env` as libpq does, and builds the driver's settings. Certificate and key files are not
/// read here (see [`super::tls::connector`]); a password file is, to refuse a missing one now.
pub fn resolve(text: &str, env: &dyn Environment) -> anyhow::Result<ConnInfo> {
    let text = text.trim();
    let params = if let Some(rest) = strip_scheme(text) {
        parse_url(rest)?
    } else if let Some(scheme_end) = text.find("://") {
        // Only a URL has "://" before its first '=' or space: an unknown scheme, not key=value.
        if !text[..scheme_end].contains(['=', ' ']) {
            anyhow::bail!(
                "DATABASE_URL is a URL of another scheme: a PostgreSQL URL starts with postgres:// or \
                 postgresql://"
            );
        }
        parse_key_values(text)?
    } else {
        parse_key_values(text)?
    };
    let info = build(&params, env)?;
    check_against_driver(text, &params)?;
    Ok(info)
}

/// Whether the connection string itself carries a password (not the environment): a string
/// given as a command-line flag then shows it to every user of the machine.
pub fn names_a_password(text: &str) -> bool {
    let text = text.trim();
    let params = match strip_scheme(text) {
        Some(rest) => parse_url(rest),
        None => parse_key_values(text),
    };
    params.is_ok_and(|params| params.iter().any(|(k, _)| k == "password"))
}

fn strip_scheme(text: &str) -> Option<&str> {
    text.strip_prefix("postgresql://").or_else(|| text.strip_prefix("postgres://"))
}

/// A value with libpq's URL decoding: `%XX` escapes (a malformed one or `%00` refused), nothing else.
fn percent_decode(text: &str, what: &str) -> anyhow::Result<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok());
            let byte = hex.and_then(|h| u8::from_str_radix(h, 16).ok());
            match byte {
                None => anyhow::bail!("DATABASE_URL has a malformed %-escape in its {what}"),
                Some(0) => anyhow::bail!("DATABASE_URL has %00 in its {what}, which libpq refuses"),
                Some(byte) => out.push(byte),
            }
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| anyhow::anyhow!("DATABASE_URL's {what} is not UTF-8 once decoded"))
}

/// The parts of a URL after its scheme, as libpq splits them: the credentials end at the first
/// `@` that comes before any `/`; hosts (`[v6]` or names, each with an optional port, separated
/// by commas) end at `/` or `?`; the database name runs from that `/` to the first `?`; the query
/// follows it. A `?`, `:` or `&` in a password is therefore part of the password.
struct UrlParts<'a> {
    user: Option<&'a str>,
    password: Option<&'a str>,
    hosts: &'a str,
    dbname: Option<&'a str>,
    query: Option<&'a str>,
}

fn split_url(rest: &str) -> anyhow::Result<UrlParts<'_>> {
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let (user, password, after) = match rest[..authority_end].find('@') {
        Some(at) => {
            let credentials = &rest[..at];
            let (user, password) = match credentials.split_once(':') {
                Some((user, password)) => (user, Some(password)),
                None => (credentials, None),
            };
            (Some(user), password, &rest[at + 1..])
        }
        None => (None, None, rest),
    };
    // Hosts and ports: up to '/' or '?', with '[…]' kept whole.
    let mut end = 0;
    let bytes = after.as_bytes();
    while end < bytes.len() && bytes[end] != b'/' && bytes[end] != b'?' {
        if bytes[end] == b'[' {
            let close = after[end..]
                .find(']')
                .ok_or_else(|| anyhow::anyhow!("DATABASE_URL has an IPv6 host without its closing ]"))?;
            end += close;
        }
        end += 1;
    }
    let hosts = &after[..end];
    let (dbname, query) = match after[end..].strip_prefix('/') {
        Some(path) => match path.split_once('?') {
            Some((dbname, query)) => (Some(dbname), Some(query)),
            None => (Some(path), None),
        },
        None => (None, after[end..].strip_prefix('?')),
    };
    Ok(UrlParts { user, password, hosts, dbname, query })
}

fn parse_url(rest: &str) -> anyhow::Result<Params> {
    let parts = split_url(rest)?;
    let mut params = Params::new();
    if let Some(user) = parts.user.filter(|u| !u.is_empty()) {
        params.push(("user".into(), percent_decode(user, "user name")?));
    }
    if let Some(password) = parts.password.filter(|p| !p.is_empty()) {
        params.push(("password".into(), percent_decode(password, "password")?));
    }
    let (mut hosts, mut ports) = (Vec::new(), Vec::new());
    if !parts.hosts.is_empty() {
        for (i, chunk) in parts.hosts.split(',').enumerate() {
            let (host, port) = if let Some(v6) = chunk.strip_prefix('[') {
                let (host, after) = v6.split_once(']').expect("split_url found the ]");
                anyhow::ensure!(!host.is_empty(), "DATABASE_URL has an empty IPv6 host (host #{})", i + 1);
                let port = match after {
                    "" => None,
                    _ => Some(after.strip_prefix(':').ok_or_else(|| {
                        anyhow::anyhow!(
                            "DATABASE_URL's host #{} has something after its ] that is not :port",
                            i + 1
                        )
                    })?),
                };
                (host, port)
            } else {
                match chunk.split_once(':') {
                    Some((host, port)) => (host, Some(port)),
                    None => (chunk, None),
                }
            };
            hosts.push(percent_decode(host, "host")?);
            ports.push(percent_decode(port.unwrap_or(""), "port")?);
        }
        if hosts.iter().any(|h| !h.is_empty()) {
            params.push(("host".into(), hosts.join(",")));
        }
        if ports.iter().any(|p| !p.is_empty()) {
            params.push(("port".into(), ports.join(",")));
        }
    }
    if let Some(dbname) = parts.dbname.filter(|d| !d.is_empty()) {
        params.push(("dbname".into(), percent_decode(dbname, "database name")?));
    }
    for (i, pair) in parts.query.unwrap_or("").split('&').filter(|p| !p.is_empty()).enumerate() {
        let Some((name, value)) = pair.split_once('=') else {
            anyhow::bail!("DATABASE_URL's query parameter #{} has no =value", i + 1);
        };
        anyhow::ensure!(!value.contains('='), "DATABASE_URL's query parameter #{} has a second =", i + 1);
        let name = percent_decode(name, "query parameters")?;
        let value = percent_decode(value, "query parameters")?;
        // JDBC's spelling, which libpq accepts too.
        if name == "ssl" && value == "true" {
            params.push(("sslmode".into(), "require".into()));
            continue;
        }
        known_keyword(&name)
            .map_err(|e| anyhow::anyhow!("DATABASE_URL's query parameter #{}: {e}", i + 1))?;
        params.push((name, value));
    }
    Ok(params)
}

/// Whether libpq (and this client) knows `name`; the error names it only when it is a known
/// keyword that is refused (an unknown one may be a fragment of a password).
fn known_keyword(name: &str) -> anyhow::Result<()> {
    if let Some((_, why)) = REFUSED.iter().find(|(k, _)| *k == name) {
        anyhow::bail!("{why}");
    }
    anyhow::ensure!(KEYWORDS.iter().any(|(k, _)| *k == name), "not a libpq connection setting");
    Ok(())
}

/// `host=… sslmode=… sslrootcert='…'` (libpq's key=value form: values unquoted up to white space
/// or single-quoted, `\` escaping the next character in both).
fn parse_key_values(text: &str) -> anyhow::Result<Params> {
    Ok(key_value_entries(text)?.into_iter().map(|(name, value, _)| (name, value)).collect())
}

/// The entries of a key=value string: name, value, and the entry's text as written.
fn key_value_entries(text: &str) -> anyhow::Result<Vec<(String, String, &str)>> {
    let mut chars = text.char_indices().peekable();
    let mut entries = Vec::new();
    let mut position = 0;
    loop {
        while chars.next_if(|(_, c)| c.is_whitespace()).is_some() {}
        let Some(&(start, _)) = chars.peek() else { break };
        position += 1;
        let mut name = String::new();
        while let Some((_, c)) = chars.next_if(|(_, c)| !c.is_whitespace() && *c != '=') {
            name.push(c);
        }
        let entry = || {
            if KEYWORDS.iter().any(|(k, _)| *k == name) {
                name.clone()
            } else {
                format!("entry #{position}")
            }
        };
        while chars.next_if(|(_, c)| c.is_whitespace()).is_some() {}
        if chars.next().map(|(_, c)| c) != Some('=') {
            anyhow::bail!(
                "DATABASE_URL is neither a postgres:// URL nor key=value settings: {} has no =value",
                entry()
            );
        }
        while chars.next_if(|(_, c)| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if chars.next_if(|(_, c)| *c == '\'').is_some() {
            loop {
                match chars.next().map(|(_, c)| c) {
                    Some('\\') => value.extend(chars.next().map(|(_, c)| c)),
                    Some('\'') => break,
                    Some(c) => value.push(c),
                    None => anyhow::bail!("DATABASE_URL has an unterminated quoted value in {}", entry()),
                }
            }
        } else {
            while let Some((_, c)) = chars.next_if(|(_, c)| !c.is_whitespace()) {
                if c == '\\' {
                    value.extend(chars.next().map(|(_, c)| c));
                } else {
                    value.push(c);
                }
            }
        }
        known_keyword(&name).map_err(|e| anyhow::anyhow!("DATABASE_URL's {}: {e}", entry()))?;
        let end = chars.peek().map_or(text.len(), |(i, _)| *i);
        entries.push((name, value, &text[start..end]));
    }
    Ok(entries)
}

/// The settings tokio-postgres' own parser knows with libpq's meaning: what it is shown of the
/// string, to compare its reading with ours.
const DRIVER_KEYWORDS: &[&str] = &[
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "options",
    "application_name",
    "connect_timeout",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "channel_binding",
    "load_balance_hosts",
];

/// Refuses `text` when tokio-postgres would read its host, port, user, password, database,
/// options or application name otherwise than [`resolve`] does: a string two readers take
/// differently is a string someone will misread, and the reading that wins must never be a silent
/// choice (the driver takes a URL's credentials up to the first `@` anywhere in it, libpq up to
/// the first `@` before a `/`). The driver is shown the string as written, less the settings it
/// does not know (the TLS ones, `passfile`, `gssencmode`, …).
fn check_against_driver(text: &str, ours: &Params) -> anyhow::Result<()> {
    let driver_text = match strip_scheme(text) {
        Some(rest) => {
            let query = split_url(rest)?.query;
            let base = &text[..text.len() - query.map_or(0, |q| q.len() + 1)];
            let kept: Vec<&str> = query
                .unwrap_or("")
                .split('&')
                .filter(|pair| DRIVER_KEYWORDS.contains(&pair.split_once('=').map_or(*pair, |(n, _)| n)))
                .collect();
            if kept.is_empty() {
                base.to_owned()
            } else {
                format!("{base}?{}", kept.join("&"))
            }
        }
        None => key_value_entries(text)?
            .into_iter()
            .filter(|(name, _, _)| DRIVER_KEYWORDS.contains(&name.as_str()))
            .map(|(_, _, raw)| raw)
            .collect::<Vec<_>>()
            .join(" "),
    };
    let differs = |what: &str| {
        anyhow::anyhow!(
            "DATABASE_URL is read differently by libpq's rules and by the PostgreSQL driver ({what}): \
             percent-encode the characters @ : / ? & # and % in the user name, password, host and \
             parameters of a URL"
        )
    };
    let driver: Config = driver_text.parse().map_err(|_| differs("the driver cannot read it"))?;
    let last = |key: &str| ours.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v.as_str());
    if driver.get_user() != last("user") {
        return Err(differs("user"));
    }
    if driver.get_password() != last("password").map(str::as_bytes) {
        return Err(differs("password"));
    }
    if driver.get_dbname() != last("dbname") {
        return Err(differs("database name"));
    }
    if driver.get_options() != last("options") {
        return Err(differs("options"));
    }
    if driver.get_application_name() != last("application_name") {
        return Err(differs("application_name"));
    }
    let our_hosts: Vec<&str> = last("host").map(|h| h.split(',').collect()).unwrap_or_default();
    let driver_hosts: Vec<String> = driver
        .get_hosts()
        .iter()
        .map(|h| match h {
            tokio_postgres::config::Host::Tcp(name) => name.clone(),
            tokio_postgres::config::Host::Unix(path) => path.display().to_string(),
        })
        .collect();
    if driver_hosts != our_hosts {
        return Err(differs("host"));
    }
    // The driver gives a host without a port 5432; ports were checked to be numbers by `build`.
    let our_ports: Vec<u16> = last("port")
        .map(|ports| ports.split(',').map(|p| p.trim().parse().unwrap_or(5432)).collect())
        .unwrap_or_default();
    let driver_ports = driver.get_ports();
    let same_ports = driver_ports == our_ports.as_slice()
        || (driver_ports.len() == 1 && our_ports.iter().all(|p| *p == driver_ports[0]));
    if !our_ports.is_empty() && !same_ports {
        return Err(differs("port"));
    }
    Ok(())
}

/// The settings, the environment filling what they leave out, as the driver's configuration.
fn build(params: &Params, env: &dyn Environment) -> anyhow::Result<ConnInfo> {
    let given = |key: &str| params.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v.clone());
    let env_of = |key: &str| {
        KEYWORDS
            .iter()
            .find(|(k, _)| *k == key)
            .and_then(|(_, var)| var.as_ref())
            .and_then(|var| env.var(var))
            .filter(|v| !v.is_empty())
    };
    let value = |key: &str| given(key).or_else(|| env_of(key));
    let mut warnings = Vec::new();
    let mut config = Config::new();

    // Where: hosts (a path is a Unix socket directory), or libpq's default socket directory.
    let hosts: Vec<String> = match value("host") {
        Some(hosts) => hosts.split(',').map(str::to_owned).collect(),
        None if value("hostaddr").is_some() => Vec::new(),
        None => vec![String::new()],
    };
    for host in &hosts {
        if host.is_empty() {
            config.host_path(default_socket_directory());
        } else if host.starts_with('/') {
            config.host_path(host);
        } else {
            config.host(host);
        }
    }
    if let Some(addrs) = value("hostaddr") {
        for addr in addrs.split(',') {
            let addr = addr
                .parse()
                .map_err(|_| anyhow::anyhow!("hostaddr is not an IP address (a host name goes in host)"))?;
            config.hostaddr(addr);
        }
    }
    let host_count = hosts.len().max(config.get_hostaddrs().len());
    match value("port") {
        None => {
            config.port(5432);
        }
        Some(ports) => {
            let ports: Vec<&str> = ports.split(',').collect();
            anyhow::ensure!(
                ports.len() == 1 || ports.len() == host_count,
                "port: {} ports for {host_count} hosts (give one port for all, or one per host)",
                ports.len()
            );
            for port in ports {
                let port = if port.is_empty() {
                    5432
                } else {
                    port.trim()
                        .parse()
                        .ok()
                        .filter(|p| *p > 0)
                        .ok_or_else(|| anyhow::anyhow!("port is not a number from 1 to 65535"))?
                };
                config.port(port);
            }
        }
    }

    // Who, and which database.
    let user = value("user")
        .or_else(|| env.var("USER").filter(|u| !u.is_empty()))
        .or_else(|| env.var("LOGNAME").filter(|u| !u.is_empty()))
        .ok_or_else(|| anyhow::anyhow!("no user: set one in DATABASE_URL or PGUSER"))?;
    config.dbname(value("dbname").unwrap_or_else(|| user.clone()));
    config.user(&user);
    if let Some(options) = value("options") {
        config.options(options);
    }
    let application_name = value("application_name").or_else(|| given("fallback_application_name"));
    if let Some(name) = &application_name {
        config.application_name(name);
    }
    if let Some(seconds) = value("connect_timeout") {
        let seconds: i64 = seconds
            .trim()
            .parse()
            .map_err(|_| anyhow::anyhow!("connect_timeout is not a whole number of seconds"))?;
        // libpq: 0 or less waits without end, and 1 is taken as 2.
        if seconds > 0 {
            config.connect_timeout(Duration::from_secs(seconds.max(2) as u64));
        }
    }

    // The password: the string's; else our password file; else PGPASSWORD; else a pgpass file.
    let password_file = env.var(PASSWORD_FILE_ENV).filter(|p| !p.is_empty()).map(PathBuf::from);
    let password = if let Some(password) = given("password") {
        anyhow::ensure!(
            password_file.is_none(),
            "DATABASE_URL has a password and {PASSWORD_FILE_ENV} names a file: give the password one way"
        );
        config.password(password);
        PasswordSource::Fixed
    } else if let Some(file) = password_file {
        read_password_file(&file)?;
        PasswordSource::File(file)
    } else if let Some(password) = env_of("password") {
        config.password(password);
        PasswordSource::Fixed
    } else {
        let file = value("passfile")
            .map(PathBuf::from)
            .or_else(|| env.var("HOME").filter(|h| !h.is_empty()).map(|h| Path::new(&h).join(".pgpass")));
        match file.map(|file| (pgpass_permissions(&file), file)) {
            Some((Ok(true), file)) => PasswordSource::Pgpass(file),
            Some((Err(warning), _)) => {
                warnings.push(warning);
                PasswordSource::Fixed
            }
            _ => PasswordSource::Fixed,
        }
    };

    // GSSAPI: none here.
    match value("gssencmode").as_deref() {
        None | Some("disable" | "prefer") => {}
        Some("require") => anyhow::bail!(
            "gssencmode=require: this client has no GSSAPI encryption; use sslmode=verify-full for an \
             encrypted, authenticated connection"
        ),
        Some(_) => anyhow::bail!("gssencmode is not one of disable, prefer, require"),
    }

    // TLS.
    let root_cert = value("sslrootcert");
    let mode = match value("sslmode") {
        Some(mode) => SslMode::parse(&mode)?,
        // libpq 16: the system's roots alone make verify-full the default.
        None if root_cert.as_deref() == Some("system") => SslMode::VerifyFull,
        None => SslMode::Prefer,
    };
    config.ssl_mode(mode.wire());
    let root_certs = match root_cert {
        Some(system) if system == "system" => {
            anyhow::ensure!(
                mode == SslMode::VerifyFull,
                "sslrootcert=system with sslmode={}: any publicly trusted certificate, issued for any \
                 host, would pass; the system's CA store is accepted only with sslmode=verify-full",
                mode.as_str()
            );
            Some(RootCerts::System)
        }
        Some(file) => Some(RootCerts::File(PathBuf::from(file))),
        None => {
            let home_root = env
                .var("HOME")
                .filter(|h| !h.is_empty())
                .map(|h| Path::new(&h).join(".postgresql/root.crt"))
                .filter(|p| p.is_file());
            match (mode, home_root) {
                (SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull, Some(file)) => {
                    Some(RootCerts::File(file))
                }
                (SslMode::VerifyFull, None) => Some(RootCerts::System),
                (SslMode::VerifyCa, None) => anyhow::bail!(
                    "sslmode=verify-ca needs sslrootcert=PATH, the CA that signs the server's \
                     certificate: the system's CA store is accepted only with sslmode=verify-full"
                ),
                _ => None,
            }
        }
    };
    let root_certs = match mode {
        SslMode::Disable | SslMode::Allow | SslMode::Prefer => None,
        _ => root_certs,
    };
    let client_cert = match (value("sslcert"), value("sslkey")) {
        (Some(cert), Some(key)) => Some((PathBuf::from(cert), PathBuf::from(key))),
        (None, None) => None,
        _ => anyhow::bail!("sslcert and sslkey go together: the client certificate and its key"),
    };

    // The rest of what the driver does.
    if let Some(attrs) = value("target_session_attrs") {
        config.target_session_attrs(match attrs.as_str() {
            "any" => TargetSessionAttrs::Any,
            "read-write" => TargetSessionAttrs::ReadWrite,
            "read-only" => TargetSessionAttrs::ReadOnly,
            "primary" | "standby" | "prefer-standby" => anyhow::bail!(
                "target_session_attrs={attrs} is not supported: use read-write (the primary) or read-only"
            ),
            _ => anyhow::bail!("target_session_attrs is not one of any, read-write, read-only"),
        });
    }
    if let Some(binding) = value("channel_binding") {
        config.channel_binding(match binding.as_str() {
            "disable" => ChannelBinding::Disable,
            "prefer" => ChannelBinding::Prefer,
            "require" => ChannelBinding::Require,
            _ => anyhow::bail!("channel_binding is not one of disable, prefer, require"),
        });
    }
    if let Some(balance) = value("load_balance_hosts") {
        config.load_balance_hosts(match balance.as_str() {
            "disable" => LoadBalanceHosts::Disable,
            "random" => LoadBalanceHosts::Random,
            _ => anyhow::bail!("load_balance_hosts is not one of disable, random"),
        });
    }
    let number = |key: &str| -> anyhow::Result<Option<u64>> {
        value(key)
            .map(|v| v.trim().parse::<u64>().map_err(|_| anyhow::anyhow!("{key} is not a whole number")))
            .transpose()
    };
    if let Some(on) = number("keepalives")? {
        config.keepalives(on != 0);
    }
    if let Some(idle) = number("keepalives_idle")?.filter(|s| *s > 0) {
        config.keepalives_idle(Duration::from_secs(idle));
    }
    if let Some(interval) = number("keepalives_interval")?.filter(|s| *s > 0) {
        config.keepalives_interval(Duration::from_secs(interval));
    }
    if let Some(count) = number("keepalives_count")? {
        config.keepalives_retries(u32::try_from(count).unwrap_or(u32::MAX));
    }
    if let Some(ms) = number("tcp_user_timeout")?.filter(|ms| *ms > 0) {
        config.tcp_user_timeout(Duration::from_millis(ms));
    }

    Ok(ConnInfo {
        config,
        tls: TlsSettings { mode, root_certs, client_cert },
        password,
        application_name_given: application_name.is_some(),
        keepalives_given: value("keepalives").is_some() || value("keepalives_idle").is_some(),
        warnings,
    })
}

/// libpq's default Unix socket directory (Debian's), or `/tmp` where that does not exist.
fn default_socket_directory() -> &'static str {
    if Path::new("/var/run/postgresql").is_dir() {
        "/var/run/postgresql"
    } else {
        "/tmp"
    }
}

/// The password in a `DATABASE_PASSWORD_FILE`: the file's text less one trailing line break (a
/// file written by `echo` has one; a Kubernetes secret has none). Errors name the file.
pub fn read_password_file(path: &Path) -> anyhow::Result<String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("{PASSWORD_FILE_ENV} {}: {e}", path.display()))?;
    let text = text.strip_suffix('\n').map(|t| t.strip_suffix('\r').unwrap_or(t)).unwrap_or(&text);
    anyhow::ensure!(!text.is_empty(), "{PASSWORD_FILE_ENV} {}: the file is empty", path.display());
    Ok(text.to_owned())
}

/// Whether a pgpass file may be used, as libpq judges it: Ok(false) when there is none, Err (a
/// warning; the file is ignored) when it is not a plain file or others may read it.
fn pgpass_permissions(path: &Path) -> Result<bool, String> {
    use std::os::unix::fs::MetadataExt as _;
    let Ok(meta) = std::fs::metadata(path) else { return Ok(false) };
    if !meta.is_file() {
        return Err(format!("password file {} is not a plain file: ignored", path.display()));
    }
    // libpq: u=rw (0600) or less; a root-owned file may also be group-readable (0640).
    let allowed = if meta.uid() == 0 { 0o037 } else { 0o077 };
    if meta.mode() & allowed != 0 {
        return Err(format!(
            "password file {} has group or world access; permissions should be u=rw (0600) or less: ignored",
            path.display()
        ));
    }
    Ok(true)
}

/// The password a pgpass file gives for a connection to `host`:`port`, database `dbname`, as
/// `user`: the first line whose fields all match (`*` matches anything; a socket directory
/// matches `localhost`), fields separated by `:` with `\` escaping. None when no line matches or
/// the file cannot be read.
pub fn pgpass_lookup(path: &Path, host: &str, port: u16, dbname: &str, user: &str) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let host = if host.is_empty() || host.starts_with('/') { "localhost" } else { host };
    let port = port.to_string();
    for line in text.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let mut fields = Vec::with_capacity(5);
        let mut field = String::new();
        let mut chars = line.chars();
        while let Some(c) = chars.next() {
            match c {
                '\\' => field.extend(chars.next()),
                ':' if fields.len() < 4 => fields.push(std::mem::take(&mut field)),
                c => field.push(c),
            }
        }
        fields.push(field);
        if fields.len() != 5 {
            continue;
        }
        let matches = |pattern: &str, value: &str| pattern == "*" || pattern == value;
        if matches(&fields[0], host)
            && matches(&fields[1], &port)
            && matches(&fields[2], dbname)
            && matches(&fields[3], user)
        {
            return Some(fields.swap_remove(4));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const NO_ENV: [(&str, &str); 0] = [];

    fn resolve_url(url: &str) -> anyhow::Result<ConnInfo> {
        resolve(url, &[("USER", "runner")])
    }

    #[test]
    fn a_question_mark_in_the_password_is_the_password_and_the_query_still_asks_for_tls() {
        let info = resolve_url("postgres://user:pa?ss@db.example.com/inbox?sslmode=require").unwrap();
        assert_eq!(info.config.get_password(), Some(&b"pa?ss"[..]));
        assert_eq!(info.tls.mode, SslMode::Require);
        assert_eq!(info.config.get_ssl_mode(), tokio_postgres::config::SslMode::Require);
        assert_eq!(info.config.get_dbname(), Some("inbox"));
        let info =
            resolve_url("postgres://user:a:b&c=d@h:6432/db?application_name=x&sslmode=verify-full").unwrap();
        assert_eq!(info.config.get_password(), Some(&b"a:b&c=d"[..]));
        assert_eq!(info.config.get_ports(), [6432]);
        assert_eq!(info.config.get_application_name(), Some("x"));
        assert_eq!(info.tls.mode, SslMode::VerifyFull);
    }

    #[test]
    fn urls_keep_their_other_parameters_and_decode_the_tls_ones() {
        let info = resolve_url(
            "postgres://inbox:p%40ss@db.example.com:6432/inbox?application_name=x&sslmode=verify-full\
             &sslrootcert=%2Fetc%2Fca%20bundle.pem&connect_timeout=3",
        )
        .unwrap();
        assert_eq!(info.tls.mode, SslMode::VerifyFull);
        assert_eq!(info.tls.root_certs, Some(RootCerts::File("/etc/ca bundle.pem".into())));
        assert_eq!(info.config.get_password(), Some(&b"p@ss"[..]));
        assert_eq!(info.config.get_connect_timeout(), Some(&Duration::from_secs(3)));
        assert_eq!(info.config.get_ssl_mode(), tokio_postgres::config::SslMode::Require);

        let info = resolve_url("postgresql://u@h/db").unwrap();
        assert_eq!(info.tls, TlsSettings::default());
        // A line break after the string (a Kubernetes secret written with echo) is not part of it.
        let info = resolve_url("postgresql://u:pw@h/db\n").unwrap();
        assert_eq!((info.config.get_dbname(), info.config.get_password()), (Some("db"), Some(&b"pw"[..])));
        assert_eq!(info.config.get_ports(), [5432]);
        let info = resolve_url("postgres://u@[::1]:5433,h2:5434/db").unwrap();
        assert_eq!(info.config.get_ports(), [5433, 5434]);
        assert_eq!(info.config.get_hosts().len(), 2);
        let info = resolve_url("postgresql:///inbox?host=%2Fvar%2Frun%2Fpostgresql&port=5433").unwrap();
        assert_eq!(
            info.config.get_hosts(),
            [tokio_postgres::config::Host::Unix("/var/run/postgresql".into())]
        );
        assert_eq!(info.config.get_user(), Some("runner"), "libpq's default user: the process's");
        let info = resolve_url("postgres://u@h/db?keepalives=0&tcp_user_timeout=1500").unwrap();
        assert!(!info.config.get_keepalives() && info.keepalives_given, "the user's keepalives are kept");
        assert_eq!(info.config.get_tcp_user_timeout(), Some(&Duration::from_millis(1500)), "milliseconds");
    }

    #[test]
    fn key_value_strings_keep_quoting() {
        assert!(
            resolve_url(r"host=db password='it''s' dbname=inbox").is_err(),
            "what follows is no key=value"
        );
        let info = resolve_url(
            r"host=db port=5433 user=inbox password='it\'s a \\ secret' sslmode = verify-full sslrootcert='/a b/ca.pem' dbname=inbox",
        )
        .unwrap();
        assert_eq!(info.tls.mode, SslMode::VerifyFull);
        assert_eq!(info.tls.root_certs, Some(RootCerts::File("/a b/ca.pem".into())));
        assert_eq!(info.config.get_password(), Some(&b"it's a \\ secret"[..]));
        assert_eq!(info.config.get_dbname(), Some("inbox"));
        assert_eq!(info.config.get_ports(), [5433]);
    }

    #[test]
    fn the_libpq_environment_fills_what_the_string_leaves_out_and_never_overrides_it() {
        let env = [
            ("PGHOST", "db.internal"),
            ("PGPORT", "6543"),
            ("PGUSER", "inbox_worker"),
            ("PGPASSWORD", "from-env"),
            ("PGDATABASE", "payments"),
            ("PGSSLMODE", "verify-full"),
            ("PGSSLROOTCERT", "/etc/ca.pem"),
            ("PGAPPNAME", "billing-worker"),
            ("PGCONNECT_TIMEOUT", "7"),
        ];
        let info = resolve("postgres://", &env).unwrap();
        assert_eq!(info.config.get_hosts(), [tokio_postgres::config::Host::Tcp("db.internal".into())]);
        assert_eq!(info.config.get_ports(), [6543]);
        assert_eq!(info.config.get_user(), Some("inbox_worker"));
        assert_eq!(info.config.get_password(), Some(&b"from-env"[..]));
        assert_eq!(info.config.get_dbname(), Some("payments"));
        assert_eq!(info.config.get_application_name(), Some("billing-worker"));
        assert!(info.application_name_given);
        assert_eq!(info.config.get_connect_timeout(), Some(&Duration::from_secs(7)));
        assert_eq!(info.tls.mode, SslMode::VerifyFull);
        assert_eq!(info.tls.root_certs, Some(RootCerts::File("/etc/ca.pem".into())));

        let info = resolve("host=other user=me sslmode=disable dbname=x", &env).unwrap();
        assert_eq!(info.config.get_hosts(), [tokio_postgres::config::Host::Tcp("other".into())]);
        assert_eq!(info.config.get_user(), Some("me"));
        assert_eq!(info.config.get_dbname(), Some("x"));
        assert_eq!(info.tls.mode, SslMode::Disable);
        assert!(resolve("postgres://h/db", &NO_ENV).unwrap_err().to_string().contains("no user"));
    }

    #[test]
    fn the_system_roots_are_accepted_only_with_verify_full() {
        for url in [
            "postgres://u@h/db?sslrootcert=system&sslmode=verify-ca",
            "postgres://u@h/db?sslrootcert=system&sslmode=require",
            "postgres://u@h/db?sslrootcert=system&sslmode=prefer",
        ] {
            let error = resolve(url, &NO_ENV).unwrap_err().to_string();
            assert!(error.contains("only with sslmode=verify-full"), "{url}: {error}");
        }
        let error = resolve("postgres://u@h/db?sslmode=verify-ca", &[("HOME", "/nonexistent")]).unwrap_err();
        assert!(error.to_string().contains("verify-ca needs sslrootcert"), "{error}");
        let info = resolve("postgres://u@h/db?sslrootcert=system", &NO_ENV).unwrap();
        assert_eq!((info.tls.mode, info.tls.root_certs), (SslMode::VerifyFull, Some(RootCerts::System)));
        let info = resolve("postgres://u@h/db?sslmode=verify-full", &[("HOME", "/nonexistent")]).unwrap();
        assert_eq!(info.tls.root_certs, Some(RootCerts::System));
        let info = resolve("postgres://u@h/db?sslmode=require", &[("HOME", "/nonexistent")]).unwrap();
        assert_eq!(info.tls.root_certs, None);
    }

    #[test]
    fn gssencmode_is_accepted_unless_it_requires_gssapi() {
        for mode in ["disable", "prefer"] {
            resolve(&format!("postgres://u@h/db?gssencmode={mode}"), &NO_ENV).unwrap();
        }
        let error = resolve("postgres://u@h/db?gssencmode=require", &NO_ENV).unwrap_err().to_string();
        assert!(error.contains("gssencmode=require"), "{error}");
        let error = resolve("postgres://u@h/db", &[("PGGSSENCMODE", "require")]).unwrap_err().to_string();
        assert!(error.contains("gssencmode=require"), "{error}");
    }

    #[test]
    fn a_string_the_driver_reads_otherwise_is_refused_naming_the_setting() {
        // The driver takes credentials up to the first '@' anywhere: here "h/db?application_name=a".
        let env = [("USER", "u")];
        let error = resolve("postgres://h/db?application_name=a@b", &env).unwrap_err().to_string();
        assert!(error.contains("read differently"), "{error}");
        assert!(error.contains("(user)"), "{error}");
        let info = resolve("postgres://h/db?application_name=a%40b", &env).unwrap();
        assert_eq!(info.config.get_application_name(), Some("a@b"));
    }

    #[test]
    fn bad_strings_are_refused_without_repeating_them() {
        for (url, expected) in [
            ("postgres://u:hunter2@h/db?sslmode=verify", "sslmode is not one of"),
            ("postgres://u:hunter2@h/db?sslcert=/c.pem", "sslcert and sslkey go together"),
            ("postgres://u:hunter2@h/db?sslpassword=x", "sslpassword is not supported"),
            ("host=h user=u password=hunter2 sslmode=", "sslmode is not one of"),
            ("postgres://u:hunter2@h/db?sslrootcert=%zz", "malformed %-escape"),
            ("postgress://user:hunter2@h/db", "another scheme"),
            ("host=h password=hunter2 2secret", "entry #3 has no =value"),
            ("host=h password=hunter 2 user=u", "entry #3 has no =value"),
            ("postgres://u:hunter2@h/db?hunter2=x", "not a libpq connection setting"),
            ("host=h hunter2=x", "entry #2: not a libpq"),
            ("postgres://u:hunter2@h:port/db", "port is not a number"),
            ("postgres://u:hunter2@h/db?password=x", "a password and"),
        ] {
            let env = [("USER", "u"), ("DATABASE_PASSWORD_FILE", "/nonexistent")];
            let result =
                if expected == "a password and" { resolve(url, &env) } else { resolve(url, &NO_ENV) };
            let error = format!("{:#}", result.err().unwrap_or_else(|| panic!("{url} is refused")));
            assert!(error.contains(expected), "{url}: {error}");
            assert!(!error.contains("hunter"), "{error}");
        }
    }

    #[test]
    fn a_password_file_is_read_now_and_may_end_in_a_line_break() {
        let dir = std::env::temp_dir().join(format!("inbox-conninfo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("password");
        std::fs::write(&file, "s3cret\n").unwrap();
        let path = file.display().to_string();
        let info = resolve("postgres://u@h/db", &[("DATABASE_PASSWORD_FILE", path.as_str())]).unwrap();
        assert_eq!(info.password, PasswordSource::File(file.clone()));
        assert_eq!(info.config.get_password(), None);
        assert_eq!(read_password_file(&file).unwrap(), "s3cret");
        let error =
            resolve("postgres://u@h/db", &[("DATABASE_PASSWORD_FILE", "/nonexistent/pw")]).unwrap_err();
        assert!(error.to_string().contains("DATABASE_PASSWORD_FILE /nonexistent/pw"), "{error}");

        // pgpass: first matching line, escapes, '*', a socket directory matching localhost.
        let pgpass = dir.join("pgpass");
        std::fs::write(&pgpass, "# comment\nother:5432:*:u:wrong\nh:5432:db:u:pa\\:ss\n*:*:*:*:fallback\n")
            .unwrap();
        assert_eq!(pgpass_lookup(&pgpass, "h", 5432, "db", "u").as_deref(), Some("pa:ss"));
        assert_eq!(pgpass_lookup(&pgpass, "/run/pg", 5432, "db", "u").as_deref(), Some("fallback"));
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&pgpass, std::fs::Permissions::from_mode(0o644)).unwrap();
        let p = pgpass.display().to_string();
        let info = resolve("postgres://u@h/db", &[("PGPASSFILE", p.as_str())]).unwrap();
        assert_eq!(info.password, PasswordSource::Fixed);
        assert!(info.warnings[0].contains("group or world access"), "{:?}", info.warnings);
        std::fs::set_permissions(&pgpass, std::fs::Permissions::from_mode(0o600)).unwrap();
        let info = resolve("postgres://u@h/db", &[("PGPASSFILE", p.as_str())]).unwrap();
        assert_eq!(info.password, PasswordSource::Pgpass(pgpass));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
