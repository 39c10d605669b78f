//! Configuration pieces both binaries share: endpoint secrets, durations and sizes.
//!
//! Secrets never reach a log line, an error message or `--help`: the types holding them print
//! `[redacted]`, and parse errors name the position of a bad entry, never its text.

use std::fmt;

/// One webhook endpoint: its name (the `{endpoint}` of the URL) and the signing secrets that
/// may have signed its deliveries (two during a secret roll).
#[derive(Clone, PartialEq, Eq)]
pub struct EndpointSpec {
    pub name: String,
    pub secrets: Vec<String>,
    /// Which of Stripe's modes this endpoint serves, when declared: an event of the other mode is
    /// stored and parked, never applied (a test event must not book into the live ledger). None:
    /// both are applied.
    pub mode: Option<EndpointMode>,
}

/// Stripe's two modes, as an endpoint declares the one it serves (`--endpoint-mode NAME=live`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointMode {
    Live,
    Test,
}

impl EndpointMode {
    /// Whether an event's `livemode` belongs to this mode. An event without a boolean `livemode`
    /// does not: it cannot show which mode it is from.
    pub fn admits(self, livemode: Option<bool>) -> bool {
        livemode == Some(self == EndpointMode::Live)
    }

    /// Why an event of `livemode` is held on arrival at `endpoint` of this mode (the message a
    /// person reads in `needs-review`), or `None` when it belongs here. The ingest and
    /// `reconcile` hold the same events with the same words.
    pub fn hold_reason(self, endpoint: &str, livemode: Option<bool>) -> Option<String> {
        (!self.admits(livemode)).then(|| {
            format!(
                "livemode: the event's livemode is {} and endpoint {endpoint} is declared {}: stored, not applied",
                livemode.map_or("absent", |live| if live { "true" } else { "false" }),
                self.as_str()
            )
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            EndpointMode::Live => "live",
            EndpointMode::Test => "test",
        }
    }
}

impl fmt::Debug for EndpointSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EndpointSpec")
            .field("name", &self.name)
            .field("secrets", &format_args!("[{} redacted]", self.secrets.len()))
            .field("mode", &self.mode)
            .finish()
    }
}

/// Why the endpoint configuration was refused. Never contains a secret.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EndpointConfigError {
    #[error("no endpoint configured: set INBOX_ENDPOINTS=NAME=SECRET[,SECRET…][;NAME=…] or pass --endpoint")]
    None,
    #[error("endpoint entry #{0} is not NAME=SECRET[,SECRET…]")]
    NotNameEqualsSecret(usize),
    #[error("endpoint entry #{0} has an invalid name (use 1-64 of A-Z a-z 0-9 _ - .)")]
    BadName(usize),
    #[error("endpoint {0:?} has an empty secret")]
    EmptySecret(String),
    #[error("endpoint {0:?} is configured twice")]
    Duplicate(String),
    #[error("endpoint mode entry #{0} is not NAME=live or NAME=test")]
    BadMode(usize),
    #[error("endpoint mode given for {0:?}, which is not a configured endpoint")]
    ModeForUnknownEndpoint(String),
    #[error("endpoint {0:?} has its mode declared twice")]
    DuplicateMode(String),
    #[error(
        "endpoint {0:?}: its secret #{1} looks like another endpoint (NAME=SECRET): separate endpoints \
         with `;` (INBOX_ENDPOINTS='billing=whsec_…;shop=whsec_…'); `,` separates the secrets of one endpoint"
    )]
    EndpointInSecretList(String, usize),
    #[error(
        "endpoint {0:?}: its secret #{1} is a Stripe API key ({2}…), not a webhook signing secret: use the \
         endpoint's signing secret (whsec_…), shown with the endpoint in Stripe's dashboard"
    )]
    ApiKeyAsSecret(String, usize, &'static str),
}

/// Prefixes of Stripe's API keys, which are never webhook signing secrets.
const API_KEY_PREFIXES: [&str; 6] = ["sk_live_", "sk_test_", "rk_live_", "rk_test_", "pk_live_", "pk_test_"];

/// The longest endpoint name accepted; names appear in URLs, rows and metric labels.
pub const MAX_ENDPOINT_NAME_LEN: usize = 64;

/// Whether `name` is acceptable as an endpoint name.
pub fn valid_endpoint_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_ENDPOINT_NAME_LEN
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
}

/// Parses endpoint entries, each `NAME=SECRET[,SECRET…]` (the `--endpoint` flag, or one
/// `;`-separated item of `INBOX_ENDPOINTS`). Empty entries (a trailing `;`) are skipped.
pub fn parse_endpoints<S: AsRef<str>>(entries: &[S]) -> Result<Vec<EndpointSpec>, EndpointConfigError> {
    let mut specs: Vec<EndpointSpec> = Vec::new();
    for (i, entry) in entries.iter().enumerate() {
        let position = i + 1;
        let entry = entry.as_ref().trim();
        if entry.is_empty() {
            continue;
        }
        let (name, secrets) =
            entry.split_once('=').ok_or(EndpointConfigError::NotNameEqualsSecret(position))?;
        let name = name.trim();
        if !valid_endpoint_name(name) {
            return Err(EndpointConfigError::BadName(position));
        }
        let secrets: Vec<String> = secrets.split(',').map(|s| s.trim().to_owned()).collect();
        if secrets.iter().any(String::is_empty) {
            return Err(EndpointConfigError::EmptySecret(name.to_owned()));
        }
        for (i, secret) in secrets.iter().enumerate() {
            // `billing=whsec_a,shop=whsec_b`: the second "secret" is an endpoint.
            if secret.split_once('=').is_some_and(|(n, _)| valid_endpoint_name(n.trim())) {
                return Err(EndpointConfigError::EndpointInSecretList(name.to_owned(), i + 1));
            }
            if let Some(prefix) = API_KEY_PREFIXES.iter().find(|p| secret.starts_with(*p)) {
                return Err(EndpointConfigError::ApiKeyAsSecret(name.to_owned(), i + 1, &prefix[..3]));
            }
        }
        if specs.iter().any(|s| s.name == name) {
            return Err(EndpointConfigError::Duplicate(name.to_owned()));
        }
        specs.push(EndpointSpec { name: name.to_owned(), secrets, mode: None });
    }
    if specs.is_empty() {
        return Err(EndpointConfigError::None);
    }
    Ok(specs)
}

/// The endpoints configured by `NAME=SECRET[,SECRET…]` entries (flags, the environment) and, when
/// given, an endpoints file in the `INBOX_ENDPOINTS` format: what the ingest serves, and what
/// `inbox-worker verify` checks kept signatures with. Errors name the file, never a secret.
pub fn load_endpoints(
    entries: &[String],
    file: Option<&std::path::Path>,
) -> anyhow::Result<Vec<EndpointSpec>> {
    use anyhow::Context as _;
    let mut entries = entries.to_vec();
    if let Some(path) = file {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the endpoints file {}", path.display()))?;
        entries.extend(split_endpoint_list(&text));
    }
    parse_endpoints(&entries).context("invalid endpoint configuration")
}

/// Applies `--endpoint-mode` entries, each `NAME=live` or `NAME=test` (or one `;`-separated item
/// of `INBOX_ENDPOINT_MODES`), to the endpoints configured. Empty entries are skipped; a mode for
/// an endpoint that is not configured is refused (a typo would otherwise leave the real endpoint
/// unguarded).
pub fn apply_endpoint_modes<S: AsRef<str>>(
    specs: &mut [EndpointSpec],
    entries: &[S],
) -> Result<(), EndpointConfigError> {
    for (i, entry) in entries.iter().enumerate() {
        let entry = entry.as_ref().trim();
        if entry.is_empty() {
            continue;
        }
        let (name, mode) = entry.split_once('=').ok_or(EndpointConfigError::BadMode(i + 1))?;
        let mode = match mode.trim() {
            "live" => EndpointMode::Live,
            "test" => EndpointMode::Test,
            _ => return Err(EndpointConfigError::BadMode(i + 1)),
        };
        let name = name.trim();
        let spec = specs
            .iter_mut()
            .find(|s| s.name == name)
            .ok_or_else(|| EndpointConfigError::ModeForUnknownEndpoint(name.to_owned()))?;
        if spec.mode.replace(mode).is_some() {
            return Err(EndpointConfigError::DuplicateMode(name.to_owned()));
        }
    }
    Ok(())
}

/// Splits the text of an endpoints file or variable into entries: `;` or newlines separate them,
/// lines starting with `#` are comments.
pub fn split_endpoint_list(text: &str) -> Vec<String> {
    text.lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .flat_map(|l| l.split(';'))
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .collect()
}

/// Warnings for secrets that are accepted but not what Stripe issues (`whsec_…`): a value pasted
/// from the wrong field signs nothing Stripe sends, and every delivery would be refused. Names the
/// endpoint and the secret's position, never the secret.
pub fn secret_warnings(specs: &[EndpointSpec]) -> Vec<String> {
    specs
        .iter()
        .flat_map(|spec| {
            spec.secrets.iter().enumerate().filter(|(_, s)| !s.starts_with("whsec_")).map(move |(i, _)| {
                format!(
                    "endpoint {:?}: its secret #{} does not start with whsec_, as Stripe's signing secrets do: \
                     check that it is the endpoint's signing secret",
                    spec.name,
                    i + 1
                )
            })
        })
        .collect()
}

/// Parses a humantime duration (`30s`, `2m`, `1h 30m`); `0` is accepted as zero seconds.
pub fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    let s = s.trim();
    if s == "0" {
        return Ok(std::time::Duration::ZERO);
    }
    humantime::parse_duration(s).map_err(|e| format!("{e} (use e.g. 30s, 2m, 1h)"))
}

/// Parses a byte size (`1MiB`, `512KiB`, `65536`).
pub fn parse_byte_size(s: &str) -> Result<u64, String> {
    s.trim()
        .parse::<bytesize::ByteSize>()
        .map(|b| b.as_u64())
        .map_err(|e| format!("{e} (use e.g. 1MiB, 512KiB, 65536)"))
}

/// A size for people, in the units [`parse_byte_size`] reads (`8.0 MiB`, `16.0 KiB`).
pub fn format_byte_size(bytes: u64) -> String {
    bytesize::ByteSize(bytes).to_string()
}

/// The warning for a secret given as a command-line flag: the process list (`ps`,
/// `/proc/PID/cmdline`) shows it to every user of the machine. Names the flag and where the
/// secret belongs, never the secret.
pub fn secret_flag_warning(flag: &str, instead: &str) -> String {
    format!(
        "{flag} carries a secret on the command line, where every user of this machine can read it \
         (ps, /proc/PID/cmdline): use {instead} instead"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse_and_refuse_without_echoing_secrets() {
        let specs = parse_endpoints(&["billing=whsec_a,whsec_b", " other = whsec_c "]).unwrap();
        assert_eq!(specs[0].name, "billing");
        assert_eq!(specs[0].secrets, vec!["whsec_a", "whsec_b"]);
        assert_eq!(specs[1].name, "other");
        assert_eq!(specs[1].secrets, vec!["whsec_c"]);
        assert!(!format!("{specs:?}").contains("whsec"));

        assert_eq!(parse_endpoints::<&str>(&[]), Err(EndpointConfigError::None));
        assert_eq!(parse_endpoints(&["whsec_nope"]), Err(EndpointConfigError::NotNameEqualsSecret(1)));
        assert_eq!(parse_endpoints(&["b=x", "bad name=whsec_1"]), Err(EndpointConfigError::BadName(2)));
        assert_eq!(parse_endpoints(&["b="]), Err(EndpointConfigError::EmptySecret("b".into())));
        assert_eq!(parse_endpoints(&["b=x,"]), Err(EndpointConfigError::EmptySecret("b".into())));
        assert_eq!(parse_endpoints(&["b=x", "b=y"]), Err(EndpointConfigError::Duplicate("b".into())));
        for e in [EndpointConfigError::NotNameEqualsSecret(1), EndpointConfigError::BadName(2)] {
            assert!(!e.to_string().contains("whsec"));
        }
    }

    #[test]
    fn a_second_endpoint_after_a_comma_or_an_api_key_is_refused_by_name_and_odd_secrets_warned() {
        let error = parse_endpoints(&["billing=whsec_a,shop=whsec_b"]).unwrap_err();
        assert_eq!(error, EndpointConfigError::EndpointInSecretList("billing".into(), 2));
        assert!(error.to_string().contains("separate endpoints with `;`"), "{error}");
        for key in ["sk_live_51abc", "rk_test_51abc", "pk_live_51abc"] {
            let error = parse_endpoints(&[format!("billing=whsec_a,{key}")]).unwrap_err();
            assert!(matches!(error, EndpointConfigError::ApiKeyAsSecret(_, 2, _)), "{error:?}");
            let text = error.to_string();
            assert!(text.contains("is a Stripe API key") && !text.contains("51abc"), "{text}");
        }
        let specs = parse_endpoints(&["billing=whsec_a,abc123", "shop=whsec_b"]).unwrap();
        let warnings = secret_warnings(&specs);
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].contains("\"billing\": its secret #2 does not start with whsec_"),
            "{warnings:?}"
        );
        assert!(!warnings[0].contains("abc123"));
    }

    #[test]
    fn endpoint_modes_apply_to_configured_endpoints_and_refuse_anything_else() {
        let mut specs = parse_endpoints(&["billing=whsec_a", "sandbox=whsec_b", "other=whsec_c"]).unwrap();
        apply_endpoint_modes(&mut specs, &["billing=live", " sandbox = test ", ""]).unwrap();
        let modes: Vec<_> = specs.iter().map(|s| s.mode).collect();
        assert_eq!(modes, [Some(EndpointMode::Live), Some(EndpointMode::Test), None]);
        assert!(EndpointMode::Live.admits(Some(true)));
        assert!(!EndpointMode::Live.admits(Some(false)));
        assert!(!EndpointMode::Live.admits(None), "an event that cannot show its mode is not admitted");
        assert!(EndpointMode::Test.admits(Some(false)));

        let mut specs = parse_endpoints(&["billing=whsec_a"]).unwrap();
        assert_eq!(apply_endpoint_modes(&mut specs, &["billing=prod"]), Err(EndpointConfigError::BadMode(1)));
        assert_eq!(apply_endpoint_modes(&mut specs, &["billing"]), Err(EndpointConfigError::BadMode(1)));
        assert_eq!(
            apply_endpoint_modes(&mut specs, &["biling=live"]),
            Err(EndpointConfigError::ModeForUnknownEndpoint("biling".into()))
        );
        assert_eq!(
            apply_endpoint_modes(&mut specs, &["billing=live", "billing=test"]),
            Err(EndpointConfigError::DuplicateMode("billing".into()))
        );
    }

    #[test]
    fn endpoint_lists_split_on_semicolons_and_lines() {
        assert_eq!(split_endpoint_list("a=1;b=2\n# c=3\nd=4;"), vec!["a=1", "b=2", "d=4"]);
    }

    #[test]
    fn durations_and_sizes() {
        assert_eq!(parse_duration("5m").unwrap().as_secs(), 300);
        assert_eq!(parse_duration("0").unwrap().as_secs(), 0);
        assert!(parse_duration("soon").is_err());
        assert_eq!(parse_byte_size("1MiB").unwrap(), 1 << 20);
        assert_eq!(parse_byte_size("65536").unwrap(), 65536);
        assert!(parse_byte_size("lots").is_err());
    }
}
