//! I-37: the node's bearer token. Made on first start as a 0600 file in the
//! data dir; every route but `/healthz`, `/readyz` and the console's login refuses a request
//! without it. Compared in constant time, so the time a refusal takes says
//! nothing of how much of a guess was right.
//!
//! Beside it, the data dir's `tokens` file (0600, optional) holds named
//! tokens, one `NAME TOKEN` a line: each opens the same routes, and a
//! decision on an approval card records the name of the token that made it
//! (the main token's name is `operator`).
//!
//! The console (a browser, whose EventSource cannot send a header, and
//! whose URLs end up in logs and history) logs in instead: `POST
//! /v1/ui/session` with a token gives a session cookie (`arbor_session`,
//! HttpOnly, SameSite=Strict), which every protected route takes in place
//! of the header. The cookie holds a random session id, never the token;
//! sessions live in memory (a restart logs the console out) for
//! `SESSION_LIFETIME`. A request that comes with the cookie from another
//! site (its `Sec-Fetch-Site`, else its `Origin` against its `Host`) is
//! refused (I-53).

use crate::error::ApiError;
use axum::extract::Request;
use axum::http::header::AUTHORIZATION;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::io::{Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use subtle::ConstantTimeEq;

/// The token file's name in the data dir.
pub const TOKEN_FILE: &str = "token";
/// The named tokens' file in the data dir.
pub const TOKENS_FILE: &str = "tokens";
/// The name the main token decides under.
pub const MAIN_TOKEN_NAME: &str = "operator";

/// The console's session cookie's name.
pub const SESSION_COOKIE: &str = "arbor_session";
/// How long a console session lasts from its login.
pub const SESSION_LIFETIME: std::time::Duration = std::time::Duration::from_secs(12 * 3600);
/// At most this many sessions at once; a login past it ends the oldest.
const MAX_SESSIONS: usize = 256;

/// Every token the node takes, each with its name, and the console's
/// sessions opened with them.
#[derive(Clone, Debug)]
pub struct Tokens {
    main: Token,
    named: Arc<[(String, Token)]>,
    sessions: Arc<std::sync::Mutex<Vec<Session>>>,
}

/// A console session: its id (the cookie's value) and who opened it.
#[derive(Debug)]
struct Session {
    id: Token,
    caller: String,
    ends: std::time::Instant,
}

/// The name of the token a request came with (a request extension).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller(pub String);

impl Tokens {
    /// The main token, and the named ones of `<data_dir>/tokens` if there is
    /// such a file: it must be 0600, each line `NAME TOKEN` (blank lines and
    /// `#` comments aside), names and tokens distinct, tokens 32 characters
    /// or more.
    pub fn load(data_dir: &Path, main: Token) -> Result<Tokens, String> {
        let path = data_dir.join(TOKENS_FILE);
        let text = match std::fs::metadata(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Tokens {
                    main,
                    named: Arc::from([]),
                    sessions: Arc::default(),
                });
            }
            Err(e) => return Err(format!("{}: {e}", path.display())),
            Ok(meta) if meta.permissions().mode() & 0o077 != 0 => {
                return Err(format!(
                    "{}: mode {:o} lets others read the tokens; make it 0600 (chmod 600)",
                    path.display(),
                    meta.permissions().mode() & 0o777
                ));
            }
            Ok(_) => {
                std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?
            }
        };
        let mut named: Vec<(String, Token)> = vec![];
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let at = |why: String| format!("{} line {}: {why}", path.display(), n + 1);
            let mut parts = line.split_whitespace();
            let (Some(name), Some(token), None) = (parts.next(), parts.next(), parts.next()) else {
                return Err(at("expected `NAME TOKEN`".into()));
            };
            let name_ok = name.len() <= 64
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
            if !name_ok {
                return Err(at(format!(
                    "{name:?} is not a token name: up to 64 letters, digits, `-`, `_` or `.`"
                )));
            }
            if name == MAIN_TOKEN_NAME || named.iter().any(|(n, _)| n == name) {
                return Err(at(format!("the name {name:?} is taken")));
            }
            if token.len() < 32 {
                return Err(at(format!(
                    "the token of {name} is too short (at least 32 characters)"
                )));
            }
            if main.matches(token) || named.iter().any(|(_, t)| t.matches(token)) {
                return Err(at(format!("the token of {name} is another name's too")));
            }
            named.push((name.to_string(), Token(token.into())));
        }
        Ok(Tokens {
            main,
            named: named.into(),
            sessions: Arc::default(),
        })
    }

    pub fn main(&self) -> &Token {
        &self.main
    }

    /// The name of the token `presented` is, if it is one. Every token is
    /// compared, in constant time each, whichever matches.
    pub fn who(&self, presented: &str) -> Option<&str> {
        let mut found = self.main.matches(presented).then_some(MAIN_TOKEN_NAME);
        for (name, token) in self.named.iter() {
            if token.matches(presented) && found.is_none() {
                found = Some(name);
            }
        }
        found
    }

    /// Opens a console session for the holder of `presented`: its id, for
    /// the cookie.
    pub fn open_session(&self, presented: &str) -> Result<String, SessionRefused> {
        let caller = self
            .who(presented)
            .ok_or(SessionRefused::WrongToken)?
            .to_string();
        let id = random_hex(32).map_err(SessionRefused::NoRandomness)?;
        let mut sessions = self.lock_sessions();
        let now = std::time::Instant::now();
        sessions.retain(|s| s.ends > now);
        if sessions.len() >= MAX_SESSIONS {
            sessions.remove(0); // the oldest
        }
        sessions.push(Session {
            id: Token(id.as_str().into()),
            caller,
            ends: now + SESSION_LIFETIME,
        });
        Ok(id)
    }

    /// Ends the session `id`, if there is one.
    pub fn close_session(&self, id: &str) {
        self.lock_sessions().retain(|s| !s.id.matches(id));
    }

    /// Who opened the live session `id`.
    fn session(&self, id: &str) -> Option<String> {
        let now = std::time::Instant::now();
        self.lock_sessions()
            .iter()
            .find(|s| s.ends > now && s.id.matches(id))
            .map(|s| s.caller.clone())
    }

    fn lock_sessions(&self) -> std::sync::MutexGuard<'_, Vec<Session>> {
        self.sessions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// How many named tokens there are, beside the main one.
    pub fn named(&self) -> usize {
        self.named.len()
    }
}

/// The node's secret. Its Debug never prints it.
#[derive(Clone)]
pub struct Token(Arc<str>);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(***)")
    }
}

impl Token {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether `presented` is this token; constant time in its content.
    pub fn matches(&self, presented: &str) -> bool {
        self.0.as_bytes().ct_eq(presented.as_bytes()).into()
    }

    /// Reads `<data_dir>/token`, or creates it (0600, 32 random bytes as
    /// hex) when there is none. A token file that others may read is
    /// refused, as ssh refuses a readable key: it is not a secret any more.
    pub fn load_or_create(data_dir: &Path) -> Result<(Token, PathBuf), String> {
        let path = data_dir.join(TOKEN_FILE);
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
        {
            Ok(mut file) => {
                let token = random_hex(32).map_err(|e| format!("/dev/urandom: {e}"))?;
                file.write_all(token.as_bytes())
                    .and_then(|_| file.sync_all())
                    .map_err(|e| format!("{}: {e}", path.display()))?;
                tracing::info!(path = %path.display(), "created the API token");
                Ok((Token(token.into()), path))
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                let mode = std::fs::metadata(&path)
                    .map_err(|e| format!("{}: {e}", path.display()))?
                    .permissions()
                    .mode();
                if mode & 0o077 != 0 {
                    return Err(format!(
                        "{}: mode {:o} lets others read the token; make it 0600 (chmod 600) or delete it to get a new one",
                        path.display(),
                        mode & 0o777
                    ));
                }
                let text = std::fs::read_to_string(&path)
                    .map_err(|e| format!("{}: {e}", path.display()))?;
                let token = text.trim();
                if token.len() < 32 {
                    return Err(format!(
                        "{}: the token is too short (at least 32 characters); delete the file to get a new one",
                        path.display()
                    ));
                }
                Ok((Token(token.into()), path))
            }
            Err(e) => Err(format!("{}: {e}", path.display())),
        }
    }
}

/// Why no session was opened.
#[derive(Debug)]
pub enum SessionRefused {
    /// The token presented is none of the node's.
    WrongToken,
    /// The session id could not be drawn (`/dev/urandom` failed): the
    /// node's fault, not the caller's.
    NoRandomness(std::io::Error),
}

fn random_hex(bytes: usize) -> std::io::Result<String> {
    let mut buf = vec![0u8; bytes];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut buf)?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// The value of the console's session cookie, if the request has one.
pub fn session_cookie(headers: &axum::http::HeaderMap) -> Option<&str> {
    headers
        .get_all(axum::http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| *name == SESSION_COOKIE)
        .map(|(_, value)| value.trim())
}

/// Why a request from a browser comes from another site, if it does: its
/// `Sec-Fetch-Site` (every current browser sends it), else an `Origin`
/// whose host is not the `Host` it was sent to. A request with neither
/// (a command-line client) is not a browser's cross-site request.
pub fn cross_site(headers: &axum::http::HeaderMap) -> Option<String> {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    if let Some(site) = header("sec-fetch-site") {
        return (!matches!(site, "same-origin" | "none"))
            .then(|| format!("the request comes from another site (Sec-Fetch-Site: {site})"));
    }
    let origin = header("origin")?;
    let host = header("host").unwrap_or_default();
    let origin_host = origin.split_once("://").map_or(origin, |(_, rest)| rest);
    (origin_host != host).then(|| format!("the request comes from {origin}, not from {host}"))
}

/// The middleware on every protected route.
pub async fn require_token(
    axum::extract::State(tokens): axum::extract::State<Tokens>,
    mut request: Request,
    next: Next,
) -> Response {
    let presented = request
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    // The console's cookie stands in for a missing header (I-53).
    if presented.is_none()
        && let Some(id) = session_cookie(request.headers())
    {
        if let Some(why) = cross_site(request.headers()) {
            return ApiError::forbidden(format!(
                "{why}: the console's session is not taken from another site"
            ))
            .into_response();
        }
        return match tokens.session(id) {
            Some(name) => {
                request.extensions_mut().insert(Caller(name));
                next.run(request).await
            }
            None => ApiError::unauthorized(
                "the console's session has ended (or this node restarted): log in again",
            )
            .into_response(),
        };
    }
    let caller = presented.and_then(|p| tokens.who(p)).map(str::to_string);
    match (presented, caller) {
        (_, Some(name)) => {
            request.extensions_mut().insert(Caller(name));
            next.run(request).await
        }
        (Some(_), None) => ApiError::unauthorized("the bearer token is wrong").into_response(),
        (None, _) => ApiError::unauthorized(
            "an `Authorization: Bearer TOKEN` header is required (the token is in the data dir's `token` file)",
        )
        .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inv_37_the_token_file_is_created_0600_and_kept_across_starts() {
        let dir = tempfile::tempdir().unwrap();
        let (first, path) = Token::load_or_create(dir.path()).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(first.as_str().len(), 64);
        let (again, _) = Token::load_or_create(dir.path()).unwrap();
        assert!(again.matches(first.as_str()));
        assert!(!again.matches(&first.as_str()[..63]));
        assert!(!again.matches(""));
        assert_eq!(format!("{first:?}"), "Token(***)");
    }

    #[test]
    fn inv_37_named_tokens_are_read_from_a_0600_file_and_each_answers_to_its_name() {
        let dir = tempfile::tempdir().unwrap();
        let (main, _) = Token::load_or_create(dir.path()).unwrap();
        let none = Tokens::load(dir.path(), main.clone()).unwrap();
        assert_eq!(none.named(), 0);
        assert_eq!(none.who(main.as_str()), Some(MAIN_TOKEN_NAME));
        let path = dir.path().join(TOKENS_FILE);
        let alice = "a".repeat(40);
        let bob = "b".repeat(40);
        std::fs::write(
            &path,
            format!("# who decides\nalice {alice}\n\nbob {bob}\n"),
        )
        .unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let tokens = Tokens::load(dir.path(), main.clone()).unwrap();
        assert_eq!(tokens.who(&alice), Some("alice"));
        assert_eq!(tokens.who(&bob), Some("bob"));
        assert_eq!(tokens.who(main.as_str()), Some(MAIN_TOKEN_NAME));
        assert_eq!(tokens.who(&"c".repeat(40)), None);
        for (text, why) in [
            (format!("alice {alice}\nalice {bob}\n"), "is taken"),
            (format!("operator {alice}\n"), "is taken"),
            (format!("alice {alice}\nbob {alice}\n"), "another name's"),
            ("alice short\n".to_string(), "too short"),
            (format!("al ice {alice}\n"), "expected `NAME TOKEN`"),
            (format!("al/ice {alice}\n"), "not a token name"),
        ] {
            std::fs::write(&path, &text).unwrap();
            let err = Tokens::load(dir.path(), main.clone()).unwrap_err();
            assert!(err.contains(why) && err.contains("line"), "{text}: {err}");
        }
        std::fs::write(&path, format!("alice {alice}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
        let err = Tokens::load(dir.path(), main).unwrap_err();
        assert!(err.contains("0600"), "{err}");
    }

    #[test]
    fn inv_37_a_token_file_others_can_read_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (_, path) = Token::load_or_create(dir.path()).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = Token::load_or_create(dir.path()).unwrap_err();
        assert!(err.contains("0600"), "{err}");
    }
}
