//! Verification of Stripe webhook signatures (the `Stripe-Signature` header).
//!
//! # The scheme
//!
//! Stripe signs every webhook delivery and sends the result in a header of the form
//!
//! ```text
//! Stripe-Signature: t=1795000000,v1=5257a869…[,v1=…][,v0=…]
//! ```
//!
//! * `t` is the Unix time (seconds) at which Stripe signed the delivery;
//! * each `v1` is a lowercase hex HMAC-SHA256 over the bytes `"{t}." + raw body`, keyed with an
//!   endpoint secret. The key is the **whole** `whsec_…` string taken as bytes — it is *not*
//!   base64-decoded. While a secret is being rolled Stripe sends one `v1` per active secret;
//! * `v0` (a legacy test-mode scheme) and any other unknown scheme are ignored.
//!
//! The body is used exactly as received (raw bytes, which need not be UTF-8): re-serialising
//! the JSON would break the signature.
//!
//! A delivery is accepted when **some** `v1` candidate equals the HMAC computed with **some**
//! secret of the endpoint (an endpoint may have several secrets during a roll), and the
//! timestamp is within the tolerance of the current time.
//!
//! # Parsing rules
//!
//! Parsing is strict; every failure below is [`SignatureError::Malformed`] unless noted:
//!
//! * no header at all is [`SignatureError::MissingHeader`]; a header that is empty, blank or not
//!   valid UTF-8 is malformed (HTTP header values are bytes, so the header is taken as `&[u8]`);
//! * the header is split on `,`; every element must be `key=value` (split at the first `=`). An
//!   element without `=` — including the empty element produced by a trailing or doubled comma —
//!   is malformed;
//! * there must be exactly one `t` (missing or duplicate `t` is malformed, even when both copies
//!   carry the same value). Its value must be 1 to 19 ASCII digits that fit in an `i64`: no sign
//!   (so negative timestamps are malformed), no inner whitespace. Leading zeros are accepted and
//!   the signed message uses the canonical decimal form of the number, as Stripe's own
//!   libraries do (they parse `t` to an integer and format it back);
//! * any number of `v1` elements is allowed; none at all is [`SignatureError::NoSignatures`]
//!   (`v0` does not count). A `v1` that is not exactly 64 hex digits is not an error by itself:
//!   it is a candidate that can never match, so another good `v1` in the same header still
//!   verifies (if it is the only one the result is [`SignatureError::NoMatch`]).
//!
//! ## Decision: whitespace
//!
//! Optional ASCII whitespace **around each element** is trimmed, so `t=1795000000, v1=…` (as
//! produced by some proxies and hand-written test tooling) is accepted, as Stripe's own
//! libraries do. Whitespace *inside* an element is not: in `t = 1795000000` the key is `"t "`
//! (an unknown scheme, ignored) and the header is then missing its `t`. The fixtures signed by
//! stripe-python contain no whitespace, so this is a strictly more lenient, harmless choice:
//! the whitespace is outside the signed material.
//!
//! ## Decision: uppercase hex
//!
//! `v1` candidates are accepted in upper, lower or mixed case. Stripe always sends lowercase,
//! but the comparison is done on the decoded 32 bytes, so accepting other cases cannot make a
//! forged signature match. [`compute_v1`] and [`sign_header`] always produce lowercase.
//!
//! ## Decision: future timestamps
//!
//! A delivery is rejected when `|now - t| > tolerance`: timestamps too far **in the future** are
//! rejected as well as stale ones. Stripe's libraries only reject old timestamps; ours is
//! deliberately stricter (a far-future timestamp would otherwise let a captured delivery be
//! replayed for longer). A difference of exactly `tolerance` is accepted.
//!
//! # Order of checks and error kinds
//!
//! As in Stripe's libraries the signature is checked first, then the timestamp:
//! [`SignatureError::TimestampOutsideTolerance`] is only returned when a `v1` matched but the
//! time is off; when nothing matched the error is [`SignatureError::NoMatch`] whatever the time.
//!
//! # Before the body: [`Verifier::precheck`]
//!
//! Everything but the HMAC can be judged from the header alone, before a byte of the body is read:
//! [`Verifier::precheck`] refuses a missing or malformed header, one without `v1`, one whose `v1`s
//! are all unusable (none is 64 hex digits: [`SignatureError::NoMatch`] whatever the body), and a
//! `t` outside the tolerance ([`SignatureError::TimestampOutsideTolerance`], whatever the `v1`s: the
//! time is not secret, so saying it is stale before knowing whether a signature matches tells a
//! sender nothing it did not know). A server checks it first and reads (and holds) a body only for
//! a header that passes, then [`Verifier::verify`]s the body. The two agree: a header that passes
//! `precheck` can still fail `verify`, and any header `verify` accepts at a time passes `precheck`
//! at that time.
//!
//! # Constant time and cost
//!
//! For each secret the expected tag is computed once (streaming `"{t}."` then the body into
//! `ring`'s HMAC, without copying the body) and every decoded candidate is compared to it with
//! a constant-time comparison. The hashing cost is therefore `secrets × body`, independent of
//! how many `v1` elements an attacker stuffs into the header.
//!
//! # Secrets never leak
//!
//! [`Verifier`] holds only precomputed `ring` HMAC keys and its `Debug` output shows the number
//! of secrets, never their value. No error's `Display`/`Debug` text contains header contents,
//! the body or a secret: malformed headers carry a static reason only.

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ring::hmac;

/// Name of the HTTP header carrying the signature.
pub const HEADER_NAME: &str = "Stripe-Signature";

/// Length in bytes of an HMAC-SHA256 tag (a `v1` value is twice this many hex digits).
const TAG_LEN: usize = 32;

/// Maximum number of digits of `t` (`i64::MAX` has 19 digits).
const MAX_T_DIGITS: usize = 19;

/// Why a `Stripe-Signature` header was rejected.
///
/// The `Display` text never contains the header, the body or a secret, so it is safe to log
/// and to return to the caller.
#[derive(Debug, thiserror::Error, Clone, Copy, PartialEq, Eq)]
pub enum SignatureError {
    /// The request has no `Stripe-Signature` header.
    #[error("missing Stripe-Signature header")]
    MissingHeader,
    /// The header does not follow the `t=…,v1=…` syntax; the payload is a static description.
    #[error("malformed Stripe-Signature header: {0}")]
    Malformed(&'static str),
    /// The header parsed but carries no `v1` signature.
    #[error("Stripe-Signature header has no v1 signature")]
    NoSignatures,
    /// No `v1` signature matches the body for any secret of the endpoint.
    #[error("no Stripe-Signature v1 signature matches the payload")]
    NoMatch,
    /// A `v1` signature matched but the timestamp is outside the tolerance (past or future).
    #[error("Stripe-Signature timestamp is outside the tolerance")]
    TimestampOutsideTolerance,
}

impl SignatureError {
    /// Short snake_case label, suitable as a metrics label value.
    pub fn reason(&self) -> &'static str {
        match self {
            SignatureError::MissingHeader => "missing_header",
            SignatureError::Malformed(_) => "malformed_header",
            SignatureError::NoSignatures => "no_v1",
            SignatureError::NoMatch => "no_match",
            SignatureError::TimestampOutsideTolerance => "stale_timestamp",
        }
    }
}

/// Why a [`Verifier`] could not be built. The texts never contain a secret.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum ConfigError {
    /// The tolerance is zero, which would reject every delivery.
    #[error("the Stripe signature tolerance must be greater than zero")]
    ZeroTolerance,
    /// No webhook signing secret was given.
    #[error("at least one Stripe webhook signing secret is required")]
    NoSecrets,
    /// One of the webhook signing secrets is empty (or only whitespace).
    #[error("a Stripe webhook signing secret is empty")]
    EmptySecret,
}

/// Verifies `Stripe-Signature` headers for one endpoint: its secrets (HMAC keys precomputed
/// once) and the timestamp tolerance.
///
/// `Debug` prints the number of secrets and the tolerance, never the secrets.
#[derive(Clone)]
pub struct Verifier {
    keys: Vec<hmac::Key>,
    /// [`fingerprint`] of each secret, in the same order: what a row and a metric record of the
    /// secret that verified it.
    fingerprints: Vec<String>,
    tolerance: Duration,
}

/// What a successful verification established: when Stripe signed the delivery, and with which
/// of the endpoint's secrets (during a roll an endpoint has several).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verified {
    /// The header's `t` (Unix seconds).
    pub timestamp: i64,
    /// The position of the secret that verified it in the endpoint's list, from 0.
    pub secret: usize,
    /// The `v1` signature that matched: the HMAC of `"{t}.{body}"` under that secret. Not a secret
    /// (it travelled in the header); kept beside the raw body, it lets anyone holding the secret
    /// prove later that the body is byte for byte what Stripe signed ([`Verifier::matching_secret`]).
    pub signature: [u8; TAG_LEN],
}

/// A short fingerprint of a signing secret: the first 8 hex digits of its SHA-256. Enough to tell
/// an endpoint's secrets apart in rows, metrics and `stats`, and to match one against the secret
/// an operator holds (`printf %s "$SECRET" | sha256sum | cut -c1-8`); not enough to recover or
/// brute-force a secret of Stripe's 32 random bytes.
pub fn fingerprint(secret: &str) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, secret.as_bytes());
    hex::encode(&digest.as_ref()[..4])
}

impl fmt::Debug for Verifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Verifier")
            .field("secret_count", &self.keys.len())
            .field("tolerance", &self.tolerance)
            .finish()
    }
}

impl Verifier {
    /// Builds a verifier for an endpoint with the given secrets (each whole `whsec_…` string is
    /// used as the key bytes) and tolerance.
    ///
    /// Refuses a zero tolerance, an empty list of secrets and an empty (or whitespace-only)
    /// secret.
    pub fn new<S: AsRef<str>>(secrets: &[S], tolerance: Duration) -> Result<Self, ConfigError> {
        if tolerance.is_zero() {
            return Err(ConfigError::ZeroTolerance);
        }
        if secrets.is_empty() {
            return Err(ConfigError::NoSecrets);
        }
        let keys = secrets
            .iter()
            .map(|secret| {
                let secret = secret.as_ref();
                if secret.trim().is_empty() {
                    Err(ConfigError::EmptySecret)
                } else {
                    Ok(hmac::Key::new(hmac::HMAC_SHA256, secret.as_bytes()))
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        let fingerprints = secrets.iter().map(|secret| fingerprint(secret.as_ref())).collect();
        Ok(Verifier { keys, fingerprints, tolerance })
    }

    /// The [`fingerprint`] of each secret, in the order they were given.
    pub fn fingerprints(&self) -> &[String] {
        &self.fingerprints
    }

    /// Verifies `header` (the raw `Stripe-Signature` value, `None` when absent) against the raw
    /// `body` at time `now_unix` (Unix seconds). Returns the verified timestamp `t` and the
    /// position of the first secret that matched.
    pub fn verify(
        &self,
        header: Option<&[u8]>,
        body: &[u8],
        now_unix: i64,
    ) -> Result<Verified, SignatureError> {
        let header = header.ok_or(SignatureError::MissingHeader)?;
        let parsed = parse_header(header)?;

        let prefix = format!("{}.", parsed.timestamp);
        let matched = self.keys.iter().enumerate().find_map(|(position, key)| {
            let expected = tag(key, prefix.as_bytes(), body);
            // Deliberately no short-circuit over candidates: the work does not depend on which
            // candidate matched.
            let hit = parsed
                .candidates
                .iter()
                .flatten()
                .fold(false, |found, candidate| found | ct_eq(&expected, candidate));
            hit.then_some((position, expected))
        });
        let Some((secret, expected)) = matched else {
            return Err(SignatureError::NoMatch);
        };

        if within_tolerance(parsed.timestamp, now_unix, self.tolerance) {
            let mut signature = [0u8; TAG_LEN];
            signature.copy_from_slice(expected.as_ref());
            Ok(Verified { timestamp: parsed.timestamp, secret, signature })
        } else {
            Err(SignatureError::TimestampOutsideTolerance)
        }
    }

    /// What can be checked of `header` before the body arrives (see the module's documentation):
    /// its shape, a `v1` that could match, and its `t` within the tolerance of `now_unix`. Returns
    /// `t`. Passing it is necessary, not sufficient: the body must still be [`Verifier::verify`]d.
    pub fn precheck(&self, header: Option<&[u8]>, now_unix: i64) -> Result<i64, SignatureError> {
        let header = header.ok_or(SignatureError::MissingHeader)?;
        let parsed = parse_header(header)?;
        if parsed.candidates.iter().all(Option::is_none) {
            // No candidate is 64 hex digits: none can ever match, whatever the body.
            return Err(SignatureError::NoMatch);
        }
        if within_tolerance(parsed.timestamp, now_unix, self.tolerance) {
            Ok(parsed.timestamp)
        } else {
            Err(SignatureError::TimestampOutsideTolerance)
        }
    }

    /// [`Verifier::precheck`] at the current system time.
    pub fn precheck_now(&self, header: Option<&[u8]>) -> Result<i64, SignatureError> {
        self.precheck(header, unix_now())
    }

    /// Which secret, if any, made `signature` for `body` at `timestamp` (no tolerance: this checks
    /// a delivery kept as evidence, not a fresh one). Constant time per secret.
    pub fn matching_secret(&self, timestamp: i64, body: &[u8], signature: &[u8]) -> Option<usize> {
        let candidate: [u8; TAG_LEN] = signature.try_into().ok()?;
        let prefix = format!("{timestamp}.");
        self.keys.iter().position(|key| ct_eq(&tag(key, prefix.as_bytes(), body), &candidate))
    }

    /// [`Verifier::verify`] at the current system time.
    pub fn verify_now(&self, header: Option<&[u8]>, body: &[u8]) -> Result<Verified, SignatureError> {
        self.verify(header, body, unix_now())
    }
}

/// Builds a valid `Stripe-Signature` header value `t={timestamp},v1={hex}` for `body`, signed
/// with `secret` (for tests, load generators and `make run` instructions).
///
/// A negative `timestamp` produces a header that [`Verifier::verify`] rejects as malformed.
pub fn sign_header(secret: &str, timestamp: i64, body: &[u8]) -> String {
    format!("t={timestamp},v1={}", compute_v1(secret, timestamp, body))
}

/// The `v1` signature of `body` at `timestamp` with `secret`, as 64 lowercase hex digits.
pub fn compute_v1(secret: &str, timestamp: i64, body: &[u8]) -> String {
    let key = hmac::Key::new(hmac::HMAC_SHA256, secret.as_bytes());
    hex::encode(tag(&key, format!("{timestamp}.").as_bytes(), body))
}

/// A parsed header: the timestamp and the `v1` candidates (`None` for a candidate that is not
/// 64 hex digits and therefore can never match).
#[derive(Debug)]
struct ParsedHeader {
    timestamp: i64,
    candidates: Vec<Option<[u8; TAG_LEN]>>,
}

fn parse_header(header: &[u8]) -> Result<ParsedHeader, SignatureError> {
    let header =
        std::str::from_utf8(header).map_err(|_| SignatureError::Malformed("header is not valid UTF-8"))?;
    if header.trim_ascii().is_empty() {
        return Err(SignatureError::Malformed("header is empty"));
    }

    let mut timestamp = None;
    let mut candidates = Vec::new();
    for element in header.split(',') {
        let (key, value) =
            element.trim_ascii().split_once('=').ok_or(SignatureError::Malformed("element without '='"))?;
        match key {
            "t" => {
                if timestamp.is_some() {
                    return Err(SignatureError::Malformed("duplicate t"));
                }
                timestamp = Some(parse_timestamp(value)?);
            }
            "v1" => candidates.push(decode_candidate(value)),
            // `v0` and unknown schemes are ignored.
            _ => {}
        }
    }

    let timestamp = timestamp.ok_or(SignatureError::Malformed("missing t"))?;
    if candidates.is_empty() {
        return Err(SignatureError::NoSignatures);
    }
    Ok(ParsedHeader { timestamp, candidates })
}

fn parse_timestamp(value: &str) -> Result<i64, SignatureError> {
    if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
        return Err(SignatureError::Malformed("t is not an unsigned decimal integer"));
    }
    if value.len() > MAX_T_DIGITS {
        return Err(SignatureError::Malformed("t is too long"));
    }
    value.parse::<i64>().map_err(|_| SignatureError::Malformed("t is out of range"))
}

fn decode_candidate(value: &str) -> Option<[u8; TAG_LEN]> {
    let mut out = [0u8; TAG_LEN];
    hex::decode_to_slice(value, &mut out).ok().map(|()| out)
}

/// HMAC-SHA256 of `prefix || body`, streamed so the body is not copied.
fn tag(key: &hmac::Key, prefix: &[u8], body: &[u8]) -> hmac::Tag {
    let mut ctx = hmac::Context::with_key(key);
    ctx.update(prefix);
    ctx.update(body);
    ctx.sign()
}

/// Constant-time equality of a computed tag and a candidate: the time taken does not depend on
/// where (or whether) they differ.
fn ct_eq(expected: &hmac::Tag, candidate: &[u8; TAG_LEN]) -> bool {
    let expected = expected.as_ref();
    if expected.len() != TAG_LEN {
        return false;
    }
    let diff = expected.iter().zip(candidate).fold(0u8, |acc, (a, b)| acc | (a ^ b));
    std::hint::black_box(diff) == 0
}

/// `|now - t| <= tolerance`, without overflow for any inputs.
fn within_tolerance(timestamp: i64, now: i64, tolerance: Duration) -> bool {
    let diff = (i128::from(now) - i128::from(timestamp)).unsigned_abs();
    match u64::try_from(diff) {
        Ok(secs) => Duration::from_secs(secs) <= tolerance,
        Err(_) => false,
    }
}

/// The current Unix time in whole seconds (negative before 1970, saturating).
fn unix_now() -> i64 {
    match SystemTime::now().duration_since(UNIX_EPOCH) {
        Ok(since) => i64::try_from(since.as_secs()).unwrap_or(i64::MAX),
        Err(before) => i64::try_from(before.duration().as_secs()).map(|secs| -secs).unwrap_or(i64::MIN),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_timestamp_and_candidates() {
        let sig = "ab".repeat(32);
        let header = format!(" t=0001795000000 ,v1={sig},v0=zz,v1=short,x=y");
        let parsed = parse_header(header.as_bytes()).unwrap();
        assert_eq!(parsed.timestamp, 1_795_000_000);
        assert_eq!(parsed.candidates.len(), 2);
        assert_eq!(parsed.candidates[0], Some([0xab; TAG_LEN]));
        assert_eq!(parsed.candidates[1], None);
    }

    #[test]
    fn timestamp_limits() {
        assert_eq!(parse_timestamp("9223372036854775807"), Ok(i64::MAX));
        assert_eq!(parse_timestamp("0"), Ok(0));
        for bad in ["", "-1", "+1", " 1", "1 ", "1.0", "9223372036854775808", "09223372036854775807", "١"] {
            assert!(matches!(parse_timestamp(bad), Err(SignatureError::Malformed(_))), "{bad:?}");
        }
    }

    #[test]
    fn tolerance_window_has_no_overflow() {
        let tol = Duration::from_secs(300);
        assert!(within_tolerance(100, 400, tol));
        assert!(within_tolerance(400, 100, tol));
        assert!(!within_tolerance(100, 401, tol));
        assert!(!within_tolerance(401, 100, tol));
        assert!(!within_tolerance(0, i64::MAX, tol));
        assert!(!within_tolerance(i64::MAX, i64::MIN, tol));
        assert!(within_tolerance(i64::MAX, i64::MIN, Duration::MAX));
        assert!(!within_tolerance(1, 0, Duration::from_millis(999)));
        assert!(within_tolerance(1, 1, Duration::from_millis(1)));
    }

    #[test]
    fn constant_time_comparison() {
        let key = hmac::Key::new(hmac::HMAC_SHA256, b"k");
        let t = tag(&key, b"1.", b"body");
        let mut bytes = [0u8; TAG_LEN];
        bytes.copy_from_slice(t.as_ref());
        assert!(ct_eq(&t, &bytes));
        for i in 0..TAG_LEN {
            let mut other = bytes;
            other[i] ^= 1;
            assert!(!ct_eq(&t, &other));
        }
    }

    #[test]
    fn streamed_tag_equals_one_shot_hmac() {
        let key = hmac::Key::new(hmac::HMAC_SHA256, b"whsec_x");
        let streamed = tag(&key, b"42.", b"{}");
        assert!(hmac::verify(&key, b"42.{}", streamed.as_ref()).is_ok());
    }

    #[test]
    fn unix_now_is_plausible() {
        assert!(unix_now() > 1_700_000_000);
    }
}
