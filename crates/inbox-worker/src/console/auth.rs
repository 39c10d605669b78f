//! Who may use the console, and how a signed-in operator is recognised.
//!
//! * **Users** come from `INBOX_CONSOLE_USERS_FILE`: one `name:argon2id-hash` per line, with
//!   `:read-only` for a user who may look but not act (`inbox-worker console hash-password` prints a
//!   line). Verification runs off the async threads (argon2 is slow on purpose).
//! * **Sessions** live in one cookie, `inbox_console`: the user, whether read-only, a random nonce
//!   and the expiry, signed with HMAC-SHA256 (ring, as the ingest's signatures) under the session key
//!   (`INBOX_CONSOLE_SESSION_KEY_FILE`; a random key per process when absent, so a restart signs
//!   everyone out). HttpOnly, SameSite=Strict, Secure when the console's public URL is https, with
//!   its expiry in the cookie and in the signed value (a copied cookie dies with it).
//!   Decision note: actix-session's cookie store would bring the cookie crate's RustCrypto stack at
//!   majors older than the ones already in the tree; a session here is four fields, signed with the
//!   HMAC the project already uses for every signature.
//! * **CSRF**: every form carries `csrf`, an HMAC of the session's nonce under the session key (the
//!   sign-in form: of a nonce in its own signed cookie, `inbox_console_login`),
//!   checked in constant time (`ring::hmac::verify`); a POST whose `Origin` or `Sec-Fetch-Site`
//!   says it came from another site is refused before that.
//! * **Sign-in attempts** are limited per user name and per client address: after 5 failures in 15
//!   minutes, the next are refused (429) until the window moves on.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use actix_web::cookie::{Cookie, SameSite};
use actix_web::http::header;
use actix_web::{FromRequest, HttpRequest, HttpResponse, ResponseError};
use argon2::password_hash::{PasswordHasher, PasswordVerifier};
use base64::Engine as _;

/// The session cookie's name.
pub const SESSION_COOKIE: &str = "inbox_console";

/// The sign-in form's cookie: a random nonce, signed; the form's CSRF token is bound to it.
pub const LOGIN_COOKIE: &str = "inbox_console_login";

/// How long a sign-in form stays usable.
const LOGIN_FORM_TTL: Duration = Duration::from_secs(3600);

/// Failed sign-ins allowed per user and per address in [`LIMIT_WINDOW`].
const LIMIT_FAILURES: usize = 5;
const LIMIT_WINDOW: Duration = Duration::from_secs(15 * 60);

/// One user of the users file.
#[derive(Clone)]
pub struct User {
    pub name: String,
    /// The PHC string (`$argon2id$v=19$…`).
    hash: String,
    pub read_only: bool,
}

impl std::fmt::Debug for User {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("User").field("name", &self.name).field("read_only", &self.read_only).finish()
    }
}

/// The users file, parsed.
#[derive(Debug, Clone, Default)]
pub struct Users(HashMap<String, User>);

impl Users {
    /// Parses the users file's text. Errors name the line, never its hash.
    pub fn parse(text: &str) -> Result<Users, String> {
        let mut users = HashMap::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let at = i + 1;
            // name:$argon2id$v=19$m=…,t=…,p=…$salt$hash[:read-only]
            let (name, rest) = line.split_once(':').ok_or(format!("line {at}: expected name:argon2-hash"))?;
            let (hash, flag) = match rest.rsplit_once(':') {
                Some((hash, flag)) if !flag.starts_with('$') => (hash, Some(flag)),
                _ => (rest, None),
            };
            let read_only = match flag {
                None => false,
                Some("read-only") => true,
                Some(_) => return Err(format!("line {at}: the only flag after the hash is read-only")),
            };
            let name = name.trim();
            if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || "._-@".contains(c)) {
                return Err(format!("line {at}: a user name is letters, digits and . _ - @"));
            }
            if !hash.starts_with("$argon2") || argon2::PasswordHash::new(hash).is_err() {
                return Err(format!(
                    "line {at} (user {name}): not an argon2 hash; `inbox-worker console hash-password` prints one"
                ));
            }
            if users
                .insert(name.to_owned(), User { name: name.to_owned(), hash: hash.to_owned(), read_only })
                .is_some()
            {
                return Err(format!("line {at}: user {name} is listed twice"));
            }
        }
        if users.is_empty() {
            return Err(
                "no users: add a line name:argon2-hash (see `inbox-worker console hash-password`)".into()
            );
        }
        Ok(Users(users))
    }

    /// Reads and parses the users file.
    pub fn load(path: &Path) -> anyhow::Result<Users> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("reading INBOX_CONSOLE_USERS_FILE {}: {e}", path.display()))?;
        Users::parse(&text).map_err(|e| anyhow::anyhow!("INBOX_CONSOLE_USERS_FILE {}: {e}", path.display()))
    }

    /// The user `name` if `password` is theirs. Slow (argon2) for a known and an unknown name alike.
    pub async fn verify(&self, name: &str, password: &str) -> Option<User> {
        let user = self.0.get(name).cloned();
        let password = password.to_owned();
        // An unknown name is checked against a hash of the same cost, so its answer takes as long.
        let hash = user.as_ref().map_or_else(|| DUMMY_HASH.to_owned(), |u| u.hash.clone());
        let ok = tokio::task::spawn_blocking(move || {
            argon2::Argon2::default().verify_password(password.as_bytes(), hash.as_str()).is_ok()
        })
        .await
        .unwrap_or(false);
        user.filter(|_| ok)
    }
}

/// An argon2id hash of a password nobody has, with the default cost: what an unknown user name is
/// checked against.
const DUMMY_HASH: &str =
    "$argon2id$v=19$m=19456,t=2,p=1$c29tZXNhbHRzb21lc2FsdA$Uj9sVtx2B0cS0cWw3i4tDGbm3Ag4nU6f9bB5kqzr8y4";

/// An argon2id hash of `password` with the library's recommended cost, as the users file wants it.
pub fn hash_password(password: &str) -> anyhow::Result<String> {
    let hash = argon2::Argon2::default()
        .hash_password(password.as_bytes())
        .map_err(|e| anyhow::anyhow!("hashing the password: {e}"))?;
    Ok(hash.to_string())
}

/// Signs and checks sessions and CSRF tokens.
#[derive(Clone)]
pub struct SessionKey {
    key: ring::hmac::Key,
}

impl SessionKey {
    /// A key from at least 32 bytes of a file (trimmed), or a random one.
    pub fn load(path: Option<&Path>) -> anyhow::Result<SessionKey> {
        let bytes = match path {
            Some(path) => {
                let text = std::fs::read(path).map_err(|e| {
                    anyhow::anyhow!("reading INBOX_CONSOLE_SESSION_KEY_FILE {}: {e}", path.display())
                })?;
                let trimmed = text.trim_ascii().to_vec();
                anyhow::ensure!(
                    trimmed.len() >= 32,
                    "INBOX_CONSOLE_SESSION_KEY_FILE {}: at least 32 bytes (e.g. `openssl rand -hex 32`)",
                    path.display()
                );
                trimmed
            }
            None => {
                let mut random = [0u8; 32];
                ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut random)
                    .map_err(|_| anyhow::anyhow!("no randomness for the session key"))?;
                random.to_vec()
            }
        };
        Ok(SessionKey { key: ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &bytes) })
    }

    fn sign(&self, data: &[u8]) -> String {
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(ring::hmac::sign(&self.key, data).as_ref())
    }

    fn verify(&self, data: &[u8], tag: &str) -> bool {
        base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(tag)
            .is_ok_and(|tag| ring::hmac::verify(&self.key, data, &tag).is_ok())
    }
}

/// A signed-in operator, as the session cookie says (the extractor of every page and action).
#[derive(Debug, Clone)]
pub struct Operator {
    pub name: String,
    pub read_only: bool,
    /// The session's random nonce: what its CSRF token signs.
    nonce: String,
    /// The CSRF token the forms of this session carry.
    pub csrf: String,
}

/// What a session cookie holds, before its signature.
fn session_value(name: &str, read_only: bool, nonce: &str, expires: u64) -> String {
    format!("{name}|{}|{nonce}|{expires}", if read_only { "ro" } else { "rw" })
}

impl Operator {
    /// Whether `token` is this session's CSRF token (constant time).
    pub fn csrf_ok(&self, key: &SessionKey, token: &str) -> bool {
        key.verify(format!("csrf|{}", self.nonce).as_bytes(), token)
    }
}

/// Refusals of the auth layer.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// No valid session: pages redirect to the sign-in form.
    #[error("sign in first")]
    SignIn,
    /// A read-only user asked for an action, or a form without a valid CSRF token, or a POST from
    /// another site.
    #[error("{0}")]
    Forbidden(String),
}

impl ResponseError for AuthError {
    fn status_code(&self) -> actix_web::http::StatusCode {
        match self {
            AuthError::SignIn => actix_web::http::StatusCode::SEE_OTHER,
            AuthError::Forbidden(_) => actix_web::http::StatusCode::FORBIDDEN,
        }
    }

    fn error_response(&self) -> HttpResponse {
        match self {
            AuthError::SignIn => {
                HttpResponse::SeeOther().insert_header((header::LOCATION, "/login")).finish()
            }
            AuthError::Forbidden(why) => HttpResponse::Forbidden()
                .content_type("text/plain; charset=utf-8")
                .body(format!("403 Forbidden: {why}\n")),
        }
    }
}

/// The console's auth settings, shared by every request.
pub struct Auth {
    pub users: Users,
    pub key: SessionKey,
    pub ttl: Duration,
    /// Cookies are `Secure` (the public URL is https).
    pub secure: bool,
    /// The origin a POST may come from (`scheme://host[:port]` of the public URL).
    pub origin: String,
    pub limiter: LoginLimiter,
}

impl Auth {
    /// A new session's cookie for `user`.
    pub fn session_cookie(&self, user: &User) -> Cookie<'static> {
        let mut nonce = [0u8; 16];
        let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut nonce);
        let nonce = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(nonce);
        let expires = unix_now() + self.ttl.as_secs();
        let value = session_value(&user.name, user.read_only, &nonce, expires);
        let signed = format!("{value}|{}", self.key.sign(value.as_bytes()));
        self.cookie(signed, self.ttl)
    }

    /// A sign-in form's token: the cookie holding its signed nonce, and the form's CSRF field.
    pub fn login_token(&self) -> (Cookie<'static>, String) {
        let mut nonce = [0u8; 16];
        let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut nonce);
        let nonce = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(nonce);
        let value = format!("{nonce}|{}", self.key.sign(format!("login|{nonce}").as_bytes()));
        let csrf = self.key.sign(format!("login-csrf|{nonce}").as_bytes());
        (self.named_cookie(LOGIN_COOKIE, value, LOGIN_FORM_TTL), csrf)
    }

    /// The cookie that ends a sign-in form's token (it signed someone in).
    pub fn login_token_spent(&self) -> Cookie<'static> {
        self.named_cookie(LOGIN_COOKIE, String::new(), Duration::ZERO)
    }

    /// Whether `token` is the CSRF field of the sign-in form whose cookie `req` carries.
    pub fn login_csrf_ok(&self, req: &HttpRequest, token: &str) -> bool {
        let Some(cookie) = req.cookie(LOGIN_COOKIE) else { return false };
        let Some((nonce, tag)) = cookie.value().split_once('|') else { return false };
        self.key.verify(format!("login|{nonce}").as_bytes(), tag)
            && self.key.verify(format!("login-csrf|{nonce}").as_bytes(), token)
    }

    /// The cookie that ends a session.
    pub fn signed_out_cookie(&self) -> Cookie<'static> {
        self.cookie(String::new(), Duration::ZERO)
    }

    fn cookie(&self, value: String, max_age: Duration) -> Cookie<'static> {
        self.named_cookie(SESSION_COOKIE, value, max_age)
    }

    fn named_cookie(&self, name: &'static str, value: String, max_age: Duration) -> Cookie<'static> {
        Cookie::build(name, value)
            .path("/")
            .http_only(true)
            .same_site(SameSite::Strict)
            .secure(self.secure)
            .max_age(actix_web::cookie::time::Duration::seconds(max_age.as_secs() as i64))
            .finish()
    }

    /// The operator of `req`'s session, if its cookie is valid and unexpired.
    pub fn operator(&self, req: &HttpRequest) -> Option<Operator> {
        let cookie = req.cookie(SESSION_COOKIE)?;
        let (value, tag) = cookie.value().rsplit_once('|')?;
        if !self.key.verify(value.as_bytes(), tag) {
            return None;
        }
        let mut fields = value.split('|');
        let (name, mode, nonce, expires) = (fields.next()?, fields.next()?, fields.next()?, fields.next()?);
        if expires.parse::<u64>().ok()? <= unix_now() {
            return None;
        }
        // The users file is the authority: a user removed from it is signed out at once.
        let user = self.users.0.get(name)?;
        let read_only = mode == "ro" || user.read_only;
        let csrf = self.key.sign(format!("csrf|{nonce}").as_bytes());
        Some(Operator { name: name.to_owned(), read_only, nonce: nonce.to_owned(), csrf })
    }

    /// Refuses a POST that says it came from another site (`Origin`, `Sec-Fetch-Site`).
    pub fn same_site(&self, req: &HttpRequest) -> Result<(), AuthError> {
        let header = |name: &str| req.headers().get(name).and_then(|v| v.to_str().ok());
        if let Some(site) = header("sec-fetch-site") {
            if !matches!(site, "same-origin" | "none") {
                return Err(AuthError::Forbidden(format!("a form posted from another site ({site})")));
            }
        }
        if let Some(origin) = header("origin") {
            if origin != self.origin {
                return Err(AuthError::Forbidden("a form posted from another origin".into()));
            }
        }
        Ok(())
    }

    /// For an action: the operator, who may act, and whose form carries this session's token.
    pub fn acting(&self, req: &HttpRequest, csrf: &str) -> Result<Operator, AuthError> {
        self.same_site(req)?;
        let operator = self.operator(req).ok_or(AuthError::SignIn)?;
        if !operator.csrf_ok(&self.key, csrf) {
            return Err(AuthError::Forbidden(
                "the form's CSRF token is missing or not this session's".into(),
            ));
        }
        if operator.read_only {
            return Err(AuthError::Forbidden(format!("{} may look, not act (read-only)", operator.name)));
        }
        Ok(operator)
    }
}

impl FromRequest for Operator {
    type Error = AuthError;
    type Future = std::future::Ready<Result<Operator, AuthError>>;

    fn from_request(req: &HttpRequest, _: &mut actix_web::dev::Payload) -> Self::Future {
        let auth = req.app_data::<actix_web::web::Data<Auth>>();
        std::future::ready(auth.and_then(|auth| auth.operator(req)).ok_or(AuthError::SignIn))
    }
}

/// Failed sign-ins per key (a user name, a client address) in the last [`LIMIT_WINDOW`].
#[derive(Debug, Default, Clone)]
pub struct LoginLimiter(Arc<Mutex<HashMap<String, Vec<Instant>>>>);

impl LoginLimiter {
    /// Whether `keys` may try again now.
    pub fn allowed(&self, keys: &[String]) -> bool {
        let mut failures = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        keys.iter().all(|key| {
            let list = failures.entry(key.clone()).or_default();
            list.retain(|at| now.duration_since(*at) < LIMIT_WINDOW);
            list.len() < LIMIT_FAILURES
        })
    }

    /// Counts a failure against `keys`.
    pub fn failed(&self, keys: &[String]) {
        let mut failures = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        // Bounded: an address spraying names cannot grow the map without end.
        if failures.len() > 100_000 {
            failures.retain(|_, list| list.iter().any(|at| now.duration_since(*at) < LIMIT_WINDOW));
        }
        for key in keys {
            failures.entry(key.clone()).or_default().push(now);
        }
    }

    /// Forgets the failures of `keys` (a successful sign-in).
    pub fn succeeded(&self, keys: &[String]) {
        let mut failures = self.0.lock().unwrap_or_else(|e| e.into_inner());
        for key in keys {
            failures.remove(key);
        }
    }
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_users_file_takes_names_hashes_and_the_read_only_flag_and_names_bad_lines_without_their_hash() {
        let hash = hash_password("correct horse").unwrap();
        let users = Users::parse(&format!("# operators\nalice:{hash}\nbob:{hash}:read-only\n")).unwrap();
        assert!(!users.0["alice"].read_only && users.0["bob"].read_only);
        for (text, says) in [
            (format!("alice {hash}"), "line 1: expected name:argon2-hash"),
            ("alice:plaintext".to_owned(), "not an argon2 hash"),
            (format!("alice:{hash}:admin"), "the only flag"),
            (format!("alice:{hash}\nalice:{hash}"), "listed twice"),
            ("# nobody".to_owned(), "no users"),
        ] {
            let error = Users::parse(&text).unwrap_err();
            assert!(error.contains(says), "{text}: {error}");
            assert!(!error.contains("$argon2"), "{error}");
        }
    }

    #[tokio::test]
    async fn a_password_verifies_against_its_hash_and_nothing_else_does() {
        let users = Users::parse(&format!("alice:{}", hash_password("correct horse").unwrap())).unwrap();
        assert_eq!(users.verify("alice", "correct horse").await.map(|u| u.name), Some("alice".into()));
        assert!(users.verify("alice", "wrong").await.is_none());
        assert!(users.verify("mallory", "correct horse").await.is_none());
    }

    #[test]
    fn five_failures_in_the_window_stop_further_attempts_and_a_success_clears_them() {
        let limiter = LoginLimiter::default();
        let keys = vec!["user:alice".to_owned(), "addr:10.0.0.1".to_owned()];
        for _ in 0..LIMIT_FAILURES {
            assert!(limiter.allowed(&keys));
            limiter.failed(&keys);
        }
        assert!(!limiter.allowed(&keys));
        assert!(!limiter.allowed(&["addr:10.0.0.1".to_owned()]), "the address is limited on its own");
        limiter.succeeded(&keys);
        assert!(limiter.allowed(&keys));
    }
}
