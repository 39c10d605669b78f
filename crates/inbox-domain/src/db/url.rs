//! `DATABASE_URL` with libpq's TLS settings.
//!
//! tokio-postgres parses connection strings (URL or key=value) but knows only `sslmode=disable|
//! prefer|require`, and refuses `verify-ca`, `verify-full`, `sslrootcert`, `sslcert` and `sslkey`
//! as unknown. So the TLS settings are taken out of the string here, the rest is left to
//! tokio-postgres, and [`super::tls`] turns the settings into a rustls configuration that does
//! what libpq does with them.

use std::path::PathBuf;

/// libpq's `sslmode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    /// No TLS.
    Disable,
    /// libpq tries without TLS first; here it behaves as `prefer` (TLS when the server offers it).
    Allow,
    /// TLS when the server offers it, without checking its certificate; else in clear.
    Prefer,
    /// TLS, without checking the certificate (unless `sslrootcert` is given: then as `verify-ca`,
    /// as libpq does).
    Require,
    /// TLS, the certificate signed by a CA of `sslrootcert`.
    VerifyCa,
    /// TLS, the certificate signed by a CA of `sslrootcert` and issued for the host connected to.
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
            other => anyhow::bail!(
                "sslmode={other:?} is not one of disable, allow, prefer, require, verify-ca, verify-full"
            ),
        })
    }

    /// What tokio-postgres must do on the wire; certificate checks are rustls'.
    fn wire(self) -> tokio_postgres::config::SslMode {
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
    /// `sslrootcert=system`: the operating system's CA store.
    System,
    /// `sslrootcert=PATH`: the PEM certificates in that file.
    File(PathBuf),
}

/// The TLS settings of a connection string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsSettings {
    pub mode: SslMode,
    /// `sslrootcert`; for `verify-ca`/`verify-full` without it, the system's CA store.
    pub root_certs: Option<RootCerts>,
    /// `sslcert` and `sslkey`: a client certificate (PEM chain) and its unencrypted PEM key.
    pub client_cert: Option<(PathBuf, PathBuf)>,
}

impl Default for TlsSettings {
    /// libpq's default: `sslmode=prefer`, nothing else.
    fn default() -> Self {
        TlsSettings { mode: SslMode::Prefer, root_certs: None, client_cert: None }
    }
}

/// Splits a connection string into what tokio-postgres parses and the TLS settings. The errors
/// never repeat the string (it may hold a password); they name the setting at fault.
pub fn split(url: &str) -> anyhow::Result<(tokio_postgres::Config, TlsSettings)> {
    let (rest, settings) = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        split_url(url)?
    } else {
        split_key_values(url)?
    };
    let mut mode = None;
    let (mut root_certs, mut cert, mut key) = (None, None, None);
    for (name, value) in settings {
        match name.as_str() {
            "sslmode" => mode = Some(SslMode::parse(&value)?),
            "sslrootcert" if value == "system" => root_certs = Some(RootCerts::System),
            "sslrootcert" => root_certs = Some(RootCerts::File(PathBuf::from(value))),
            "sslcert" => cert = Some(PathBuf::from(value)),
            "sslkey" => key = Some(PathBuf::from(value)),
            other => anyhow::bail!(
                "{other} is not supported: certificates and keys must be unencrypted PEM files, and \
                 revocation lists are not read"
            ),
        }
    }
    let client_cert = match (cert, key) {
        (Some(cert), Some(key)) => Some((cert, key)),
        (None, None) => None,
        _ => anyhow::bail!("sslcert and sslkey go together: the client certificate and its key"),
    };
    let tls = TlsSettings { mode: mode.unwrap_or(SslMode::Prefer), root_certs, client_cert };
    let mut config: tokio_postgres::Config = rest
        .parse()
        .map_err(|e| anyhow::anyhow!("DATABASE_URL is not a valid PostgreSQL connection string: {e}"))?;
    config.ssl_mode(tls.mode.wire());
    Ok((config, tls))
}

/// The TLS settings this module takes out of a connection string (those tokio-postgres refuses,
/// and `sslmode`, whose values it knows only in part).
fn is_tls_setting(name: &str) -> bool {
    matches!(name, "sslmode" | "sslrootcert" | "sslcert" | "sslkey" | "sslpassword" | "sslcrl" | "sslcrldir")
}

/// `postgres://…?a=b&sslmode=…`: the URL without its TLS parameters, and those (percent-decoded).
fn split_url(url: &str) -> anyhow::Result<(String, Vec<(String, String)>)> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_owned(), Vec::new()));
    };
    let mut kept = Vec::new();
    let mut settings = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let name = percent_decode(name)?;
        if is_tls_setting(&name) {
            settings.push((name, percent_decode(value)?));
        } else {
            kept.push(pair);
        }
    }
    let rest = if kept.is_empty() { base.to_owned() } else { format!("{base}?{}", kept.join("&")) };
    Ok((rest, settings))
}

fn percent_decode(text: &str) -> anyhow::Result<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok());
            let byte = hex.and_then(|h| u8::from_str_radix(h, 16).ok());
            let Some(byte) = byte else {
                anyhow::bail!("DATABASE_URL has a malformed %-escape in its parameters")
            };
            out.push(byte);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out)
        .map_err(|_| anyhow::anyhow!("DATABASE_URL's parameters are not UTF-8 once decoded"))
}

/// `host=… sslmode=… sslrootcert='…'` (libpq's key=value form: values unquoted up to white space
/// or single-quoted, `\` escaping the next character in both): the string without its TLS
/// settings, and those.
fn split_key_values(text: &str) -> anyhow::Result<(String, Vec<(String, String)>)> {
    let mut chars = text.chars().peekable();
    let mut kept = Vec::new();
    let mut settings = Vec::new();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.peek().is_none() {
            break;
        }
        let mut name = String::new();
        while let Some(c) = chars.next_if(|c| !c.is_whitespace() && *c != '=') {
            name.push(c);
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.next() != Some('=') {
            anyhow::bail!("DATABASE_URL is not a valid PostgreSQL connection string: {name:?} has no value");
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if chars.next_if_eq(&'\'').is_some() {
            loop {
                match chars.next() {
                    Some('\\') => value.extend(chars.next()),
                    Some('\'') => break,
                    Some(c) => value.push(c),
                    None => anyhow::bail!("DATABASE_URL has an unterminated quoted value for {name:?}"),
                }
            }
        } else {
            while let Some(c) = chars.next_if(|c| !c.is_whitespace()) {
                if c == '\\' {
                    value.extend(chars.next());
                } else {
                    value.push(c);
                }
            }
        }
        if is_tls_setting(&name) {
            settings.push((name, value));
        } else {
            let quoted = value.replace('\\', "\\\\").replace('\'', "\\'");
            kept.push(format!("{name}='{quoted}'"));
        }
    }
    Ok((kept.join(" "), settings))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_keep_their_other_parameters_and_lose_the_tls_ones() {
        let (config, tls) = split(
            "postgres://inbox:p%40ss@db.example.com:6432/inbox?application_name=x&sslmode=verify-full\
             &sslrootcert=%2Fetc%2Fca%20bundle.pem&connect_timeout=3",
        )
        .unwrap();
        assert_eq!(tls.mode, SslMode::VerifyFull);
        assert_eq!(tls.root_certs, Some(RootCerts::File("/etc/ca bundle.pem".into())));
        assert_eq!(config.get_password(), Some(&b"p@ss"[..]));
        assert_eq!(config.get_application_name(), Some("x"));
        assert_eq!(config.get_connect_timeout(), Some(&std::time::Duration::from_secs(3)));
        assert_eq!(config.get_ssl_mode(), tokio_postgres::config::SslMode::Require);

        let (config, tls) = split("postgresql://u@h/db").unwrap();
        assert_eq!(tls, TlsSettings::default());
        assert_eq!(config.get_ssl_mode(), tokio_postgres::config::SslMode::Prefer);
        let (_, tls) = split("postgres://u@h/db?sslrootcert=system&sslmode=verify-ca").unwrap();
        assert_eq!((tls.mode, tls.root_certs), (SslMode::VerifyCa, Some(RootCerts::System)));
    }

    #[test]
    fn key_value_strings_keep_quoting_and_lose_the_tls_settings() {
        // A doubled quote is not libpq's escape: the value ends at the second quote.
        assert!(split(r"host=db password='it''s' dbname=inbox").is_err(), "what follows is no key=value");
        let (config, tls) = split(
            r"host=db port=5433 user=inbox password='it\'s a \\ secret' sslmode = verify-full sslrootcert='/a b/ca.pem' dbname=inbox",
        )
        .unwrap();
        assert_eq!(tls.mode, SslMode::VerifyFull);
        assert_eq!(tls.root_certs, Some(RootCerts::File("/a b/ca.pem".into())));
        assert_eq!(config.get_password(), Some(&b"it's a \\ secret"[..]));
        assert_eq!(config.get_dbname(), Some("inbox"));
        assert_eq!(config.get_ports(), [5433]);
    }

    #[test]
    fn bad_tls_settings_are_refused_without_repeating_the_string() {
        for (url, expected) in [
            ("postgres://u:hunter2@h/db?sslmode=verify", "sslmode=\"verify\""),
            ("postgres://u:hunter2@h/db?sslcert=/c.pem", "sslcert and sslkey go together"),
            ("postgres://u:hunter2@h/db?sslpassword=x", "sslpassword is not supported"),
            ("host=h password=hunter2 sslmode=", "sslmode=\"\""),
            ("postgres://u:hunter2@h/db?sslrootcert=%zz", "malformed %-escape"),
        ] {
            let error = split(url).unwrap_err().to_string();
            assert!(error.contains(expected), "{url}: {error}");
            assert!(!error.contains("hunter2"), "{error}");
        }
    }
}
