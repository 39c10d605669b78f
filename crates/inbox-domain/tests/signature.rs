//! Tests of the Stripe webhook signature verifier: the shared fixtures (signed and judged by
//! stripe-python), edge cases of the header syntax and of the tolerance, and properties.

use std::time::Duration;

use inbox_domain::inbox::signature::{
    compute_v1, fingerprint, sign_header, ConfigError, SignatureError, Verified, Verifier,
};
use proptest::prelude::*;
use proptest::sample::Index;
use serde::Deserialize;

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/stripe_signatures.json");
const SHARED_FIXTURE: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/fixtures/stripe_signatures.json");

const SECRET: &str = "whsec_test_5ecret_A1b2C3d4E5f6G7h8";
const SECRET_2: &str = "whsec_test_5ecret_Z9y8X7w6V5u4T3s2";
const OTHER_SECRET: &str = "whsec_not_the_endpoint_secret_000";
const NOW: i64 = 1_795_000_000;
const TOL: u64 = 300;
const BODY: &[u8] = br#"{"id":"evt_1","object":"event","type":"invoice.paid"}"#;

// ---------------------------------------------------------------------------------------------
// Fixtures
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Deserialize)]
struct Fixture {
    vectors: Vec<Vector>,
}

#[derive(Debug, Deserialize)]
struct Vector {
    name: String,
    payload: String,
    header: String,
    secrets: Vec<String>,
    now: i64,
    tolerance_s: u64,
    valid: bool,
}

fn load_fixture() -> Fixture {
    let text = std::fs::read_to_string(FIXTURE).expect("read the in-tree fixture");
    serde_json::from_str(&text).expect("parse the fixture")
}

#[test]
fn fixtures_agree_with_stripe_python() {
    let fixture = load_fixture();
    assert!(fixture.vectors.len() >= 15, "too few vectors: {}", fixture.vectors.len());
    for v in &fixture.vectors {
        let verifier = Verifier::new(&v.secrets, Duration::from_secs(v.tolerance_s))
            .unwrap_or_else(|e| panic!("{}: config refused: {e}", v.name));
        let result = verifier.verify(Some(v.header.as_bytes()), v.payload.as_bytes(), v.now);
        assert_eq!(
            result.is_ok(),
            v.valid,
            "vector {:?}: expected valid={}, got {:?}",
            v.name,
            v.valid,
            result
        );
    }
}

#[test]
fn fixtures_have_the_expected_error_kinds() {
    let fixture = load_fixture();
    let expect = |name: &str| -> Result<i64, SignatureError> {
        match name {
            "timestamp 299 s old" => Ok(NOW - 299),
            "timestamp 301 s old" => Err(SignatureError::TimestampOutsideTolerance),
            "only v0" | "no v1" => Err(SignatureError::NoSignatures),
            "wrong secret"
            | "payload changed"
            | "signature made for another timestamp"
            | "v1 not hex"
            | "v1 truncated" => Err(SignatureError::NoMatch),
            "no t" | "empty header" | "garbage header" | "non-numeric t" => {
                Err(SignatureError::Malformed(""))
            }
            _ => Ok(NOW),
        }
    };
    for v in &fixture.vectors {
        let verifier = Verifier::new(&v.secrets, Duration::from_secs(v.tolerance_s)).unwrap();
        let got =
            verifier.verify(Some(v.header.as_bytes()), v.payload.as_bytes(), v.now).map(|v| v.timestamp);
        match (expect(&v.name), got) {
            (Err(SignatureError::Malformed(_)), Err(SignatureError::Malformed(_))) => {}
            (want, got) => assert_eq!(got, want, "vector {:?}", v.name),
        }
    }
}

#[test]
fn in_tree_fixture_is_a_copy_of_the_shared_one() {
    let in_tree = std::fs::read(FIXTURE).expect("read the in-tree fixture");
    match std::fs::read(SHARED_FIXTURE) {
        Ok(shared) => {
            assert!(shared == in_tree, "{FIXTURE} differs from {SHARED_FIXTURE}: copy it again byte for byte")
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => panic!("cannot read {SHARED_FIXTURE}: {e}"),
    }
}

#[test]
fn verification_names_the_secret_that_matched_by_position_and_a_stable_fingerprint() {
    let rolling = Verifier::new(&["whsec_old", "whsec_new"], Duration::from_secs(TOL)).unwrap();
    for (position, secret) in ["whsec_old", "whsec_new"].into_iter().enumerate() {
        let header = sign_header(secret, NOW, BODY);
        let verified: Verified = rolling.verify(Some(header.as_bytes()), BODY, NOW).unwrap();
        assert_eq!((verified.timestamp, verified.secret), (NOW, position));
        assert_eq!(hex::encode(verified.signature), compute_v1(secret, NOW, BODY), "the v1 that matched");
        // Kept as evidence, it names its secret again later, and nothing else matches it.
        assert_eq!(rolling.matching_secret(NOW, BODY, &verified.signature), Some(position));
        assert_eq!(rolling.matching_secret(NOW + 1, BODY, &verified.signature), None);
        assert_eq!(rolling.matching_secret(NOW, b"{}", &verified.signature), None);
        assert_eq!(rolling.matching_secret(NOW, BODY, &verified.signature[..31]), None);
    }
    // SHA-256 prefixes computed independently (Python's hashlib); never the secret itself.
    assert_eq!(rolling.fingerprints(), ["3d269a69", "06626a5e"]);
    assert_eq!(fingerprint("whsec_old"), "3d269a69");
    assert!(!format!("{rolling:?}").contains("whsec"));
}

#[test]
fn compute_v1_reproduces_the_fixture_signature() {
    let fixture = load_fixture();
    let v = fixture.vectors.iter().find(|v| v.name == "valid").expect("a vector named \"valid\"");
    let sig = compute_v1(&v.secrets[0], NOW, v.payload.as_bytes());
    assert_eq!(sig, "ceb95b7aa0175567f4d1be621b7d6385dcb5a0ec78a1e82542ab00973768253a");
    assert_eq!(sign_header(&v.secrets[0], NOW, v.payload.as_bytes()), v.header);
}

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

fn verifier() -> Verifier {
    Verifier::new(&[SECRET], Duration::from_secs(TOL)).unwrap()
}

fn good_sig() -> String {
    compute_v1(SECRET, NOW, BODY)
}

fn check(header: &str) -> Result<i64, SignatureError> {
    verifier().verify(Some(header.as_bytes()), BODY, NOW).map(|v| v.timestamp)
}

fn assert_malformed(header: &str) {
    let got = check(header);
    assert!(matches!(got, Err(SignatureError::Malformed(_))), "{header:?}: expected Malformed, got {got:?}");
}

// ---------------------------------------------------------------------------------------------
// Header syntax
// ---------------------------------------------------------------------------------------------

#[test]
fn valid_header_returns_its_timestamp() {
    assert_eq!(check(&sign_header(SECRET, NOW, BODY)), Ok(NOW));
}

#[test]
fn missing_header() {
    assert_eq!(verifier().verify(None, BODY, NOW), Err(SignatureError::MissingHeader));
}

#[test]
fn empty_and_blank_headers_are_malformed() {
    assert_malformed("");
    assert_malformed(" ");
    assert_malformed("\t \t");
    assert_malformed(",");
}

#[test]
fn no_t_is_malformed() {
    assert_malformed(&format!("v1={}", good_sig()));
    assert_malformed(&format!("v0=1,v1={}", good_sig()));
}

#[test]
fn non_numeric_t_is_malformed() {
    for t in ["abc", "", "1795000000a", "0x6a", "1.5", "1e9", "１２３", "17950 00000"] {
        assert_malformed(&format!("t={t},v1={}", good_sig()));
    }
}

#[test]
fn negative_or_signed_t_is_malformed() {
    for t in ["-1795000000", "-0", "+1795000000"] {
        assert_malformed(&format!("t={t},v1={}", good_sig()));
    }
    // sign_header happily formats a negative timestamp; the verifier refuses it.
    let header = sign_header(SECRET, -5, BODY);
    assert!(matches!(
        verifier().verify(Some(header.as_bytes()), BODY, -5),
        Err(SignatureError::Malformed(_))
    ));
}

#[test]
fn t_out_of_range_is_malformed() {
    assert_malformed(&format!("t=9223372036854775808,v1={}", good_sig()));
    assert_malformed(&format!("t=99999999999999999999,v1={}", good_sig()));
    assert_malformed(&format!("t=00000000000001795000000,v1={}", good_sig()));
}

#[test]
fn t_at_i64_max_is_parsed() {
    let header = sign_header(SECRET, i64::MAX, BODY);
    assert_eq!(verifier().verify(Some(header.as_bytes()), BODY, i64::MAX).map(|v| v.timestamp), Ok(i64::MAX));
    assert_eq!(
        verifier().verify(Some(header.as_bytes()), BODY, i64::MIN),
        Err(SignatureError::TimestampOutsideTolerance)
    );
}

#[test]
fn t_with_leading_zeros_is_the_same_number() {
    // Stripe's libraries parse `t` to an integer and sign its canonical form.
    assert_eq!(check(&format!("t=0{NOW},v1={}", good_sig())), Ok(NOW));
}

#[test]
fn duplicate_t_is_malformed() {
    let sig = good_sig();
    assert_malformed(&format!("t={NOW},t={NOW},v1={sig}"));
    assert_malformed(&format!("t={NOW},v1={sig},t={}", NOW + 1));
    assert_malformed(&format!("t={},t={NOW},v1={sig}", NOW + 1));
}

#[test]
fn element_without_equals_is_malformed() {
    let sig = good_sig();
    assert_malformed("garbage");
    assert_malformed(&format!("t={NOW},garbage,v1={sig}"));
    assert_malformed(&format!("t={NOW},v1={sig},"));
    assert_malformed(&format!("t={NOW},,v1={sig}"));
    assert_malformed(&format!(",t={NOW},v1={sig}"));
}

#[test]
fn only_v0_is_no_signatures() {
    let sig = good_sig();
    assert_eq!(check(&format!("t={NOW},v0={sig}")), Err(SignatureError::NoSignatures));
    assert_eq!(check(&format!("t={NOW}")), Err(SignatureError::NoSignatures));
    assert_eq!(check(&format!("t={NOW},v2={sig},V1={sig}")), Err(SignatureError::NoSignatures));
}

#[test]
fn v0_and_unknown_schemes_beside_a_good_v1_are_ignored() {
    let sig = good_sig();
    assert_eq!(check(&format!("t={NOW},v0=xyz,v1={sig},v9=,foo=bar=baz,=x")), Ok(NOW));
}

#[test]
fn v1_of_wrong_length_never_matches() {
    let sig = good_sig();
    for bad in [
        String::new(),
        sig[..63].to_string(),
        format!("{sig}0"),
        sig[..62].to_string(),
        format!("{sig}00"),
        sig.repeat(2),
    ] {
        assert_eq!(check(&format!("t={NOW},v1={bad}")), Err(SignatureError::NoMatch), "{bad:?}");
        // ...but does not spoil a good v1 beside it.
        assert_eq!(check(&format!("t={NOW},v1={bad},v1={sig}")), Ok(NOW));
    }
}

#[test]
fn v1_non_hex_never_matches() {
    let sig = good_sig();
    for bad in [
        format!("zz{}", &sig[2..]),
        format!("{} ", &sig[..63]),
        format!("{}g", &sig[..63]),
        format!("0x{}", &sig[..62]),
        format!("{}é", &sig[..62]),
    ] {
        assert_eq!(check(&format!("t={NOW},v1={bad}")), Err(SignatureError::NoMatch), "{bad:?}");
        assert_eq!(check(&format!("t={NOW},v1={sig},v1={bad}")), Ok(NOW));
    }
}

#[test]
fn one_good_v1_among_several() {
    let good = good_sig();
    let bad1 = compute_v1(OTHER_SECRET, NOW, BODY);
    let bad2 = compute_v1(SECRET, NOW + 1, BODY);
    for header in [
        format!("t={NOW},v1={good},v1={bad1},v1={bad2}"),
        format!("t={NOW},v1={bad1},v1={good},v1={bad2}"),
        format!("t={NOW},v1={bad1},v1={bad2},v1={good}"),
        format!("v1={bad1},v1={good},t={NOW}"),
    ] {
        assert_eq!(check(&header), Ok(NOW), "{header}");
    }
    assert_eq!(check(&format!("t={NOW},v1={bad1},v1={bad2}")), Err(SignatureError::NoMatch));
}

#[test]
fn many_v1_candidates_are_handled() {
    let bad = compute_v1(OTHER_SECRET, NOW, BODY);
    let mut header = format!("t={NOW}");
    for _ in 0..500 {
        header.push_str(",v1=");
        header.push_str(&bad);
    }
    assert_eq!(check(&header), Err(SignatureError::NoMatch));
    header.push_str(",v1=");
    header.push_str(&good_sig());
    assert_eq!(check(&header), Ok(NOW));
}

#[test]
fn whitespace_around_elements_is_accepted() {
    let sig = good_sig();
    for header in [
        format!("t={NOW}, v1={sig}"),
        format!(" t={NOW} , v1={sig} "),
        format!("t={NOW},\tv1={sig}\t"),
        format!("t={NOW},\r\n v1={sig}"),
    ] {
        assert_eq!(check(&header), Ok(NOW), "{header:?}");
    }
}

#[test]
fn whitespace_inside_elements_is_not_accepted() {
    let sig = good_sig();
    // `t ` is an unknown scheme, so `t` is missing.
    assert_malformed(&format!("t ={NOW},v1={sig}"));
    // The value of `t` must be digits only.
    assert_malformed(&format!("t= {NOW},v1={sig}"));
    // `v1 ` is an unknown scheme: no v1 at all.
    assert_eq!(check(&format!("t={NOW},v1 ={sig}")), Err(SignatureError::NoSignatures));
    // A v1 value with inner whitespace is not 64 hex digits.
    assert_eq!(check(&format!("t={NOW},v1= {sig}")), Err(SignatureError::NoMatch));
}

#[test]
fn uppercase_and_mixed_case_hex_are_accepted() {
    let sig = good_sig();
    assert_eq!(check(&format!("t={NOW},v1={}", sig.to_uppercase())), Ok(NOW));
    let mixed: String =
        sig.chars().enumerate().map(|(i, c)| if i % 2 == 0 { c.to_ascii_uppercase() } else { c }).collect();
    assert_eq!(check(&format!("t={NOW},v1={mixed}")), Ok(NOW));
}

#[test]
fn non_utf8_header_is_malformed() {
    let mut header = sign_header(SECRET, NOW, BODY).into_bytes();
    header.extend_from_slice(b",x=\xff\xfe");
    assert!(matches!(verifier().verify(Some(&header), BODY, NOW), Err(SignatureError::Malformed(_))));
    assert!(matches!(verifier().verify(Some(b"\xc3\x28"), BODY, NOW), Err(SignatureError::Malformed(_))));
}

// ---------------------------------------------------------------------------------------------
// Tolerance
// ---------------------------------------------------------------------------------------------

fn at(t: i64, now: i64) -> Result<i64, SignatureError> {
    verifier().verify(Some(sign_header(SECRET, t, BODY).as_bytes()), BODY, now).map(|v| v.timestamp)
}

#[test]
fn timestamp_exactly_at_tolerance_is_accepted() {
    let tol = TOL as i64;
    assert_eq!(at(NOW - tol, NOW), Ok(NOW - tol));
    assert_eq!(at(NOW + tol, NOW), Ok(NOW + tol));
    assert_eq!(at(NOW - tol + 1, NOW), Ok(NOW - tol + 1));
}

#[test]
fn timestamp_just_outside_tolerance_is_rejected() {
    let tol = TOL as i64;
    assert_eq!(at(NOW - tol - 1, NOW), Err(SignatureError::TimestampOutsideTolerance));
}

#[test]
fn future_timestamp_beyond_tolerance_is_rejected() {
    let tol = TOL as i64;
    assert_eq!(at(NOW + tol + 1, NOW), Err(SignatureError::TimestampOutsideTolerance));
    assert_eq!(at(NOW + 86_400, NOW), Err(SignatureError::TimestampOutsideTolerance));
}

#[test]
fn stale_and_unsigned_is_no_match_not_stale() {
    // Signature is checked first: a bad signature is NoMatch even when the time is also off.
    let header = format!("t={},v1={}", NOW - 10_000, good_sig());
    assert_eq!(check(&header), Err(SignatureError::NoMatch));
}

#[test]
fn extreme_clocks_do_not_panic() {
    assert_eq!(at(0, i64::MAX), Err(SignatureError::TimestampOutsideTolerance));
    assert_eq!(at(0, i64::MIN), Err(SignatureError::TimestampOutsideTolerance));
    assert_eq!(at(0, 0), Ok(0));
    let forever = Verifier::new(&[SECRET], Duration::MAX).unwrap();
    let header = sign_header(SECRET, 0, BODY);
    assert_eq!(forever.verify(Some(header.as_bytes()), BODY, i64::MIN).map(|v| v.timestamp), Ok(0));
}

#[test]
fn sub_second_tolerance_only_accepts_the_same_second() {
    let v = Verifier::new(&[SECRET], Duration::from_millis(500)).unwrap();
    let header = sign_header(SECRET, NOW, BODY);
    assert_eq!(v.verify(Some(header.as_bytes()), BODY, NOW).map(|v| v.timestamp), Ok(NOW));
    assert_eq!(
        v.verify(Some(header.as_bytes()), BODY, NOW + 1),
        Err(SignatureError::TimestampOutsideTolerance)
    );
}

#[test]
fn verify_now_uses_the_system_clock() {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
    let v = verifier();
    let fresh = sign_header(SECRET, now, BODY);
    assert_eq!(v.verify_now(Some(fresh.as_bytes()), BODY).map(|v| v.timestamp), Ok(now));
    let stale = sign_header(SECRET, now - 3_600, BODY);
    assert_eq!(v.verify_now(Some(stale.as_bytes()), BODY), Err(SignatureError::TimestampOutsideTolerance));
    assert_eq!(v.verify_now(None, BODY), Err(SignatureError::MissingHeader));
}

// ---------------------------------------------------------------------------------------------
// Body and secrets
// ---------------------------------------------------------------------------------------------

#[test]
fn body_altered_by_one_byte_is_no_match() {
    let header = sign_header(SECRET, NOW, BODY);
    let mut body = BODY.to_vec();
    body[10] ^= 0x01;
    assert_eq!(verifier().verify(Some(header.as_bytes()), &body, NOW), Err(SignatureError::NoMatch));
    let mut longer = BODY.to_vec();
    longer.push(b'\n');
    assert_eq!(verifier().verify(Some(header.as_bytes()), &longer, NOW), Err(SignatureError::NoMatch));
    assert_eq!(
        verifier().verify(Some(header.as_bytes()), &BODY[..BODY.len() - 1], NOW),
        Err(SignatureError::NoMatch)
    );
}

#[test]
fn non_utf8_body_is_verified_on_bytes() {
    let body: &[u8] = b"\xff\xfe\x00{\"id\":\"evt\xc3\x28\"}\x80";
    let header = sign_header(SECRET, NOW, body);
    assert_eq!(verifier().verify(Some(header.as_bytes()), body, NOW).map(|v| v.timestamp), Ok(NOW));
    assert_eq!(verifier().verify(Some(header.as_bytes()), &body[1..], NOW), Err(SignatureError::NoMatch));
}

#[test]
fn empty_body_is_verified() {
    let header = sign_header(SECRET, NOW, b"");
    assert_eq!(verifier().verify(Some(header.as_bytes()), b"", NOW).map(|v| v.timestamp), Ok(NOW));
}

#[test]
fn any_secret_of_the_endpoint_matches() {
    let v = Verifier::new(&[SECRET, SECRET_2], Duration::from_secs(TOL)).unwrap();
    for secret in [SECRET, SECRET_2] {
        let header = sign_header(secret, NOW, BODY);
        assert_eq!(v.verify(Some(header.as_bytes()), BODY, NOW).map(|v| v.timestamp), Ok(NOW));
    }
    let header = sign_header(OTHER_SECRET, NOW, BODY);
    assert_eq!(v.verify(Some(header.as_bytes()), BODY, NOW), Err(SignatureError::NoMatch));
}

#[test]
fn secret_is_not_base64_decoded() {
    // The key is the whole `whsec_…` string; the part after the prefix alone must not match.
    let header = sign_header(SECRET.trim_start_matches("whsec_"), NOW, BODY);
    assert_eq!(check(&header), Err(SignatureError::NoMatch));
}

// ---------------------------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------------------------

#[test]
fn new_refuses_zero_tolerance() {
    assert_eq!(Verifier::new(&[SECRET], Duration::ZERO).unwrap_err(), ConfigError::ZeroTolerance);
}

#[test]
fn new_refuses_no_secrets() {
    let none: [&str; 0] = [];
    assert_eq!(Verifier::new(&none, Duration::from_secs(TOL)).unwrap_err(), ConfigError::NoSecrets);
    let none: Vec<String> = Vec::new();
    assert_eq!(Verifier::new(&none, Duration::from_secs(TOL)).unwrap_err(), ConfigError::NoSecrets);
}

#[test]
fn new_refuses_an_empty_secret() {
    for secrets in [vec![""], vec![SECRET, ""], vec!["", SECRET], vec![" \t"]] {
        assert_eq!(
            Verifier::new(&secrets, Duration::from_secs(TOL)).unwrap_err(),
            ConfigError::EmptySecret,
            "{secrets:?}"
        );
    }
}

#[test]
fn new_accepts_strings_and_strs() {
    let body = b"{}";
    let now = 1_795_000_000;
    let owned = vec![SECRET.to_string(), SECRET_2.to_string()];
    let v = Verifier::new(&owned, Duration::from_secs(60)).unwrap();
    assert_eq!(
        v.verify(Some(sign_header(SECRET_2, now, body).as_bytes()), body, now + 60).map(|v| v.timestamp),
        Ok(now)
    );
    assert_eq!(
        v.verify(Some(sign_header(SECRET_2, now, body).as_bytes()), body, now + 61),
        Err(SignatureError::TimestampOutsideTolerance)
    );
    let v = Verifier::new(&[SECRET], Duration::from_secs(TOL)).unwrap();
    assert_eq!(
        v.verify(Some(sign_header(SECRET_2, now, body).as_bytes()), body, now),
        Err(SignatureError::NoMatch)
    );
}

#[test]
fn debug_of_verifier_hides_the_secrets() {
    let v = Verifier::new(&[SECRET, SECRET_2], Duration::from_secs(TOL)).unwrap();
    for text in [format!("{v:?}"), format!("{v:#?}")] {
        assert!(!text.contains(SECRET), "{text}");
        assert!(!text.contains(SECRET_2), "{text}");
        assert!(!text.contains("5ecret"), "{text}");
        assert!(!text.contains("whsec"), "{text}");
        assert!(text.contains('2'), "{text}");
    }
}

#[test]
fn config_errors_do_not_show_the_secret() {
    let errors = [
        Verifier::new(&[SECRET], Duration::ZERO).unwrap_err(),
        Verifier::new(&[SECRET, ""], Duration::from_secs(1)).unwrap_err(),
        Verifier::new(&[] as &[&str], Duration::from_secs(1)).unwrap_err(),
    ];
    for e in errors {
        for text in [e.to_string(), format!("{e:?}")] {
            assert!(!text.is_empty());
            assert!(!text.contains(SECRET), "{text}");
            assert!(!text.contains("5ecret"), "{text}");
        }
    }
}

#[test]
fn signature_errors_do_not_show_the_header_or_the_secret() {
    // Every header below carries a marker; no error text may echo it.
    const MARK: &str = "MARKER";
    let sig = good_sig();
    let cases: Vec<(Option<Vec<u8>>, SignatureError)> = vec![
        (None, SignatureError::MissingHeader),
        (Some(MARK.as_bytes().to_vec()), SignatureError::Malformed("")),
        (Some(format!("t={MARK},v1={sig}").into_bytes()), SignatureError::Malformed("")),
        (Some(format!("t={NOW},{MARK},v1={sig}").into_bytes()), SignatureError::Malformed("")),
        (Some(format!("t={NOW},t={NOW},v1={MARK}").into_bytes()), SignatureError::Malformed("")),
        (Some(format!("{MARK}=1,v1={sig}").into_bytes()), SignatureError::Malformed("")),
        (Some(format!("t={NOW},v1={MARK}\u{ff}").into_bytes()), SignatureError::NoMatch),
        (Some([b"t=1,v1=".as_slice(), MARK.as_bytes(), b"\xff"].concat()), SignatureError::Malformed("")),
        (Some(format!("t={NOW},v0={MARK}").into_bytes()), SignatureError::NoSignatures),
        (
            Some(sign_header(SECRET, NOW - 1_000, BODY).into_bytes()),
            SignatureError::TimestampOutsideTolerance,
        ),
    ];
    let v = verifier();
    for (header, want) in cases {
        let err = v.verify(header.as_deref(), BODY, NOW).unwrap_err();
        match (want, err) {
            (SignatureError::Malformed(_), SignatureError::Malformed(_)) => {}
            _ => assert_eq!(err, want, "{header:?}"),
        }
        for text in [err.to_string(), format!("{err:?}"), err.reason().to_string()] {
            assert!(!text.is_empty());
            assert!(!text.contains(MARK), "{text}");
            assert!(!text.contains(SECRET), "{text}");
            assert!(!text.contains("5ecret"), "{text}");
            assert!(!text.contains(&sig), "{text}");
            assert!(!text.contains(&NOW.to_string()), "{text}");
        }
    }
}

#[test]
fn reason_labels() {
    let labels = [
        (SignatureError::MissingHeader, "missing_header"),
        (SignatureError::Malformed("x"), "malformed_header"),
        (SignatureError::NoSignatures, "no_v1"),
        (SignatureError::NoMatch, "no_match"),
        (SignatureError::TimestampOutsideTolerance, "stale_timestamp"),
    ];
    for (err, label) in labels {
        assert_eq!(err.reason(), label);
        assert!(label.bytes().all(|b| b.is_ascii_lowercase() || b == b'_' || b.is_ascii_digit()));
    }
}

#[test]
fn compute_v1_is_lowercase_hex_and_sign_header_has_the_stripe_shape() {
    let sig = compute_v1(SECRET, NOW, BODY);
    assert_eq!(sig.len(), 64);
    assert!(sig.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
    assert_eq!(sign_header(SECRET, NOW, BODY), format!("t={NOW},v1={sig}"));
    assert_ne!(compute_v1(SECRET, NOW + 1, BODY), sig);
    assert_ne!(compute_v1(SECRET_2, NOW, BODY), sig);
}

// ---------------------------------------------------------------------------------------------
// Before the body: precheck
// ---------------------------------------------------------------------------------------------

fn precheck(header: &str) -> Result<i64, SignatureError> {
    verifier().precheck(Some(header.as_bytes()), NOW)
}

#[test]
fn precheck_passes_a_well_formed_fresh_header_without_the_body() {
    assert_eq!(precheck(&sign_header(SECRET, NOW, BODY)), Ok(NOW));
    // The v1 is judged only with the body: a well-formed one that will not match passes.
    assert_eq!(precheck(&format!("t={NOW},v1={}", "0".repeat(64))), Ok(NOW));
    assert_eq!(precheck(&format!("t={NOW},v1={}", compute_v1(OTHER_SECRET, NOW, BODY))), Ok(NOW));
    // The same leniencies as verify: whitespace around elements, upper case, leading zeros,
    // v0 and unknown schemes, unusable v1s beside a usable one.
    let sig = good_sig();
    for header in [
        format!(" t={NOW} , v1={} ", sig.to_uppercase()),
        format!("t=0{NOW},v0=xyz,v1=short,v1={sig},foo=bar"),
        format!("v1={sig},t={NOW}"),
    ] {
        assert_eq!(precheck(&header), Ok(NOW), "{header:?}");
    }
}

#[test]
fn precheck_refuses_what_no_body_can_save() {
    let sig = good_sig();
    assert_eq!(verifier().precheck(None, NOW), Err(SignatureError::MissingHeader));
    for header in [
        String::new(),
        " ".into(),
        "garbage".into(),
        format!("v1={sig}"),
        format!("t=abc,v1={sig}"),
        format!("t=-1,v1={sig}"),
        format!("t={NOW},t={NOW},v1={sig}"),
        format!("t={NOW},v1={sig},"),
        format!("t=9223372036854775808,v1={sig}"),
    ] {
        let got = precheck(&header);
        assert!(matches!(got, Err(SignatureError::Malformed(_))), "{header:?}: {got:?}");
    }
    assert!(matches!(verifier().precheck(Some(b"t=1,v1=\xff"), NOW), Err(SignatureError::Malformed(_))));
    assert_eq!(precheck(&format!("t={NOW},v0={sig}")), Err(SignatureError::NoSignatures));
    assert_eq!(precheck(&format!("t={NOW}")), Err(SignatureError::NoSignatures));
    // Not one v1 of 64 hex digits: nothing can match.
    for header in [
        format!("t={NOW},v1="),
        format!("t={NOW},v1={}", &sig[..63]),
        format!("t={NOW},v1={},v1=zz{}", &sig[..62], &sig[2..]),
    ] {
        assert_eq!(precheck(&header), Err(SignatureError::NoMatch), "{header:?}");
        assert_eq!(check(&header), Err(SignatureError::NoMatch), "verify agrees: {header:?}");
    }
}

#[test]
fn precheck_refuses_a_timestamp_outside_the_tolerance_whatever_the_v1() {
    let tol = TOL as i64;
    let pre = |t: i64| verifier().precheck(Some(sign_header(SECRET, t, BODY).as_bytes()), NOW);
    assert_eq!(pre(NOW - tol), Ok(NOW - tol));
    assert_eq!(pre(NOW + tol), Ok(NOW + tol));
    assert_eq!(pre(NOW - tol - 1), Err(SignatureError::TimestampOutsideTolerance));
    assert_eq!(pre(NOW + tol + 1), Err(SignatureError::TimestampOutsideTolerance));
    assert_eq!(pre(0), Err(SignatureError::TimestampOutsideTolerance));
    // Unlike verify, which says NoMatch for a stale header whose v1 does not match: the time
    // alone decides here, and both are a refusal.
    let stale_unsigned = format!("t={},v1={}", NOW - 10_000, "0".repeat(64));
    assert_eq!(precheck(&stale_unsigned), Err(SignatureError::TimestampOutsideTolerance));
    assert_eq!(check(&stale_unsigned), Err(SignatureError::NoMatch));
    // Extreme clocks do not panic.
    let at_max = sign_header(SECRET, i64::MAX, BODY);
    assert_eq!(
        verifier().precheck(Some(at_max.as_bytes()), i64::MIN),
        Err(SignatureError::TimestampOutsideTolerance)
    );
    assert_eq!(verifier().precheck(Some(at_max.as_bytes()), i64::MAX), Ok(i64::MAX));
}

#[test]
fn precheck_now_uses_the_system_clock() {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
    let v = verifier();
    assert_eq!(v.precheck_now(Some(sign_header(SECRET, now, BODY).as_bytes())), Ok(now));
    assert_eq!(
        v.precheck_now(Some(sign_header(SECRET, now - 3_600, BODY).as_bytes())),
        Err(SignatureError::TimestampOutsideTolerance)
    );
    assert_eq!(v.precheck_now(None), Err(SignatureError::MissingHeader));
}

#[test]
fn precheck_errors_do_not_show_the_header() {
    const MARK: &str = "MARKER";
    for header in [
        MARK.to_owned(),
        format!("t={MARK},v1={}", good_sig()),
        format!("t={NOW},v1={MARK}"),
        format!("t={NOW},v0={MARK}"),
        format!("t={},v1={MARK}{}", NOW - 1_000, &good_sig()[6..]),
    ] {
        let err = precheck(&header).unwrap_err();
        for text in [err.to_string(), format!("{err:?}")] {
            assert!(!text.contains(MARK) && !text.contains(&NOW.to_string()), "{text}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Properties
// ---------------------------------------------------------------------------------------------

/// 1 to 3 distinct, non-blank secrets.
fn secrets() -> impl Strategy<Value = Vec<String>> {
    prop::collection::hash_set("whsec_[A-Za-z0-9]{0,40}|\\PC{1,24}", 1..=3)
        .prop_map(|set| set.into_iter().collect::<Vec<_>>())
        .prop_filter("secrets must not be blank", |secrets| secrets.iter().all(|s| !s.trim().is_empty()))
}

/// (tolerance in seconds, timestamp, offset of `now` within the tolerance).
fn clock() -> impl Strategy<Value = (u64, i64, i64)> {
    (1u64..=3_600).prop_flat_map(|tol| {
        let t = tol as i64;
        (Just(tol), t..=i64::MAX - t, -t..=t)
    })
}

const HEX: &[u8; 16] = b"0123456789abcdef";

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// (a) A header signed with any one of the endpoint's secrets verifies at any `now` within
    /// the tolerance.
    #[test]
    fn prop_signed_with_any_endpoint_secret_verifies(
        body in prop::collection::vec(any::<u8>(), 0..4096),
        secrets in secrets(),
        which in any::<Index>(),
        (tol, t, offset) in clock(),
    ) {
        let verifier = Verifier::new(&secrets, Duration::from_secs(tol)).unwrap();
        let header = sign_header(&secrets[which.index(secrets.len())], t, &body);
        prop_assert_eq!(verifier.verify(Some(header.as_bytes()), &body, t + offset).map(|v| v.timestamp), Ok(t));
    }

    /// (b) Flipping any bits of any one byte of the body makes verification fail.
    #[test]
    fn prop_flipped_body_byte_fails(
        body in prop::collection::vec(any::<u8>(), 1..4096),
        secrets in secrets(),
        which in any::<Index>(),
        (tol, t, offset) in clock(),
        pos in any::<Index>(),
        mask in 1u8..=255,
    ) {
        let verifier = Verifier::new(&secrets, Duration::from_secs(tol)).unwrap();
        let header = sign_header(&secrets[which.index(secrets.len())], t, &body);
        let mut tampered = body.clone();
        let i = pos.index(tampered.len());
        tampered[i] ^= mask;
        prop_assert_eq!(
            verifier.verify(Some(header.as_bytes()), &tampered, t + offset),
            Err(SignatureError::NoMatch)
        );
    }

    /// (c) Replacing the header's timestamp by any other value (still within the tolerance)
    /// makes verification fail.
    #[test]
    fn prop_other_timestamp_fails(
        body in prop::collection::vec(any::<u8>(), 0..4096),
        secrets in secrets(),
        which in any::<Index>(),
        (tol, t, delta) in clock().prop_filter("a different timestamp", |(_, _, d)| *d != 0),
    ) {
        let verifier = Verifier::new(&secrets, Duration::from_secs(tol)).unwrap();
        let sig = compute_v1(&secrets[which.index(secrets.len())], t, &body);
        let header = format!("t={},v1={sig}", t + delta);
        prop_assert_eq!(
            verifier.verify(Some(header.as_bytes()), &body, t),
            Err(SignatureError::NoMatch)
        );
    }

    /// (d) Replacing any one hex digit of the signature by another hex digit makes
    /// verification fail.
    #[test]
    fn prop_changed_signature_digit_fails(
        body in prop::collection::vec(any::<u8>(), 0..4096),
        secrets in secrets(),
        which in any::<Index>(),
        (tol, t, offset) in clock(),
        pos in 0usize..64,
        step in 1usize..16,
    ) {
        let verifier = Verifier::new(&secrets, Duration::from_secs(tol)).unwrap();
        let mut sig = compute_v1(&secrets[which.index(secrets.len())], t, &body).into_bytes();
        let old = HEX.iter().position(|&h| h == sig[pos]).unwrap();
        sig[pos] = HEX[(old + step) % 16];
        let header = format!("t={t},v1={}", String::from_utf8(sig).unwrap());
        prop_assert_eq!(
            verifier.verify(Some(header.as_bytes()), &body, t + offset),
            Err(SignatureError::NoMatch)
        );
    }

    /// The precheck never refuses what verify would accept, and verify never accepts what the
    /// precheck refused, whatever the header, body and clock; a signed header within the
    /// tolerance passes it.
    #[test]
    fn prop_precheck_agrees_with_verify(
        header in prop::collection::vec(any::<u8>(), 0..256),
        text in "[tv01=, a-fA-F0-9\\-]{0,200}",
        body in prop::collection::vec(any::<u8>(), 0..256),
        secrets in secrets(),
        which in any::<Index>(),
        (tol, t, offset) in clock(),
        skew in -7_200i64..=7_200,
    ) {
        let verifier = Verifier::new(&secrets, Duration::from_secs(tol)).unwrap();
        let signed = sign_header(&secrets[which.index(secrets.len())], t, &body);
        prop_assert_eq!(verifier.precheck(Some(signed.as_bytes()), t + offset), Ok(t));
        let candidates = [header, text.into_bytes(), signed.into_bytes()];
        for now in [t + offset, t.saturating_add(skew)] {
            for candidate in &candidates {
                let pre = verifier.precheck(Some(candidate), now);
                if let Ok(verified) = verifier.verify(Some(candidate), &body, now) {
                    prop_assert_eq!(pre, Ok(verified.timestamp));
                }
                if pre.is_err() {
                    prop_assert!(verifier.verify(Some(candidate), &body, now).is_err());
                }
            }
        }
    }

    /// Arbitrary header bytes never panic, and only a correct signature is ever accepted.
    #[test]
    fn prop_arbitrary_headers_never_panic(
        header in prop::collection::vec(any::<u8>(), 0..256),
        text in "[tv01=, a-fA-F0-9\\-]{0,200}",
        now in any::<i64>(),
    ) {
        let verifier = verifier();
        prop_assert!(verifier.verify(Some(&header), BODY, now).is_err());
        prop_assert!(verifier.verify(Some(text.as_bytes()), BODY, now).is_err());
    }
}
