//! I-37: the node's bearer token. Made on first start as a 0600 file in the
//! data dir; every route but `/healthz`, `/readyz` and the console's login refuses a request
//! without it. Compared in constant time, so the time a refusal takes says
//! nothing of how much of a guess was right.
//!
//! Beside it, the data dir's `tokens` file (`credentials.rs`) holds named
//! credentials, each with a tenant and roles; a route answers a credential
//! without the role it needs (`required_role`) 403 (I-63). A decision on
//! an approval card records the name of the credential that made it (the
//! main token's, an admin of every tenant, is `operator`).
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
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use subtle::ConstantTimeEq;

/// The token file's name in the data dir.
pub const TOKEN_FILE: &str = "token";
pub use crate::credentials::Caller;
pub use crate::credentials::MAIN_TOKEN_NAME;
pub use crate::credentials::TOKENS_FILE;
use crate::credentials::{self, Credential, Roles, random_hex};

/// The console's session cookie's name.
pub const SESSION_COOKIE: &str = "arbor_session";
/// How long a console session lasts from its login.
pub const SESSION_LIFETIME: std::time::Duration = std::time::Duration::from_secs(12 * 3600);
/// At most this many sessions at once; a login past it ends the oldest.
const MAX_SESSIONS: usize = 256;

/// Every token the node takes: the main one, and the named credentials
/// of `<data_dir>/tokens` (read again when the file changes); and the
/// console's sessions opened with them.
#[derive(Clone, Debug)]
pub struct Tokens {
    main: Token,
    data_dir: Arc<Path>,
    named: Arc<std::sync::Mutex<Named>>,
    sessions: Arc<std::sync::Mutex<Vec<Session>>>,
    /// `[auth.oidc]`: bearer JWTs from a provider, if configured.
    oidc: Option<Arc<crate::oidc::Oidc>>,
    /// The tenants arbor.toml names (`default` without `[tenants]`): a
    /// credential of another is refused.
    tenants: Arc<[String]>,
}

/// The credentials as last read, and the file's state then.
#[derive(Debug, Default)]
struct Named {
    seen: Option<(std::time::SystemTime, u64)>,
    credentials: Arc<[Credential]>,
}

/// A console session: its id (the cookie's value) and who opened it.
#[derive(Debug)]
struct Session {
    id: Token,
    who: Opener,
    ends: std::time::Instant,
}

/// Who opened a session: a credential of the node's, looked up again at
/// each request (so a revocation ends it), or a JWT's caller, as its
/// provider said, until the JWT expires.
#[derive(Debug)]
enum Opener {
    Named(String),
    Jwt(Caller),
}

impl Tokens {
    /// The main token, and the credentials of `<data_dir>/tokens` if there
    /// is such a file (`credentials::load`: 0600, each line checked; an
    /// old-format file is rewritten hashed, and said on stderr).
    pub fn load(data_dir: &Path, main: Token) -> Result<Tokens, String> {
        let tokens = Tokens {
            main,
            data_dir: Arc::from(data_dir),
            named: Arc::default(),
            sessions: Arc::default(),
            oidc: None,
            tenants: Arc::from([arbor_protocol::DEFAULT_TENANT.to_string()]),
        };
        let rewritten = tokens.refresh()?;
        if rewritten > 0 {
            eprintln!(
                "arbord: {}: {rewritten} token(s) were kept in the clear; the file now keeps                  their SHA-256, each still an admin of every tenant (`arbor token list`)",
                data_dir.join(TOKENS_FILE).display()
            );
        }
        Ok(tokens)
    }

    /// Reads the file again if it changed since; the old-format lines it
    /// rewrote. A file that no longer reads keeps what was read before.
    fn refresh(&self) -> Result<usize, String> {
        let path = self.data_dir.join(TOKENS_FILE);
        let now = std::fs::metadata(&path)
            .ok()
            .map(|m| (m.modified().unwrap_or(std::time::UNIX_EPOCH), m.len()));
        let mut named = self.named.lock().unwrap_or_else(|p| p.into_inner());
        if named.seen.is_some() && named.seen == now {
            return Ok(0);
        }
        let loaded = credentials::load(&self.data_dir, self.main.as_str())?;
        named.credentials = loaded.credentials.into();
        // A file rewritten hashed (`load`) changed again since it was looked at.
        named.seen = match loaded.rewritten {
            0 => now,
            _ => std::fs::metadata(&path)
                .ok()
                .map(|m| (m.modified().unwrap_or(std::time::UNIX_EPOCH), m.len())),
        };
        Ok(loaded.rewritten)
    }

    fn credentials(&self) -> Arc<[Credential]> {
        if let Err(why) = self.refresh() {
            tracing::warn!(%why, "the tokens file does not read; keeping the credentials read before");
        }
        self.named
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .credentials
            .clone()
    }

    pub fn main(&self) -> &Token {
        &self.main
    }

    /// The tenants arbor.toml names.
    pub fn with_tenants(mut self, tenants: Vec<String>) -> Self {
        self.tenants = tenants.into();
        self
    }

    /// Takes bearer JWTs of `[auth.oidc]` too.
    pub fn with_oidc(mut self, oidc: Option<crate::oidc::Oidc>) -> Self {
        self.oidc = oidc.map(Arc::new);
        self
    }

    /// Who a bearer credential stands for: a token of the node's, else a
    /// JWT of its OIDC provider; or why it is refused.
    pub fn identify(&self, presented: &str) -> Result<Caller, String> {
        if let Some(caller) = self.who(presented) {
            return Ok(caller);
        }
        match &self.oidc {
            Some(oidc) if presented.matches('.').count() == 2 => oidc.verify(presented),
            _ => Err("the bearer token is wrong".into()),
        }
    }

    /// Who holds `presented`, if it is a token of the node's. Every digest
    /// is compared, in constant time each, whichever matches.
    pub fn who(&self, presented: &str) -> Option<Caller> {
        let mut found = self.main.matches(presented).then(|| Caller {
            name: MAIN_TOKEN_NAME.into(),
            tenant: None,
            roles: Roles::admin(),
        });
        let hash = credentials::digest(presented);
        for c in self.credentials().iter() {
            let same: bool = c.hash.as_bytes().ct_eq(hash.as_bytes()).into();
            if same && found.is_none() {
                found = Some(caller_of(c));
            }
        }
        found
    }

    /// The caller a live credential's name stands for now (a session's;
    /// none once it is revoked).
    fn named_caller(&self, name: &str) -> Option<Caller> {
        if name == MAIN_TOKEN_NAME {
            return Some(Caller {
                name: name.into(),
                tenant: None,
                roles: Roles::admin(),
            });
        }
        self.credentials()
            .iter()
            .find(|c| c.name == name)
            .map(caller_of)
    }

    /// Opens a console session for the holder of `presented`, a token of
    /// the node's or a JWT of its OIDC provider: its id, for the cookie.
    /// A JWT's session ends when the JWT does, if that is sooner.
    pub fn open_session(&self, presented: &str) -> Result<String, SessionRefused> {
        let now = std::time::Instant::now();
        let (who, ends) = match self.who(presented) {
            Some(caller) => (Opener::Named(caller.name), now + SESSION_LIFETIME),
            None => match &self.oidc {
                Some(oidc) if presented.matches('.').count() == 2 => {
                    let (caller, exp) = oidc
                        .verify_until(presented)
                        .map_err(SessionRefused::Refused)?;
                    let left = std::time::UNIX_EPOCH + std::time::Duration::from_secs(exp);
                    let left = left
                        .duration_since(std::time::SystemTime::now())
                        .unwrap_or_default();
                    (Opener::Jwt(caller), now + left.min(SESSION_LIFETIME))
                }
                _ => return Err(SessionRefused::Refused("the token is wrong".into())),
            },
        };
        let id = random_hex(32).map_err(SessionRefused::NoRandomness)?;
        let mut sessions = self.lock_sessions();
        sessions.retain(|s| s.ends > now);
        if sessions.len() >= MAX_SESSIONS {
            sessions.remove(0); // the oldest
        }
        sessions.push(Session {
            id: Token(id.as_str().into()),
            who,
            ends,
        });
        Ok(id)
    }

    /// Ends the session `id`, if there is one; who had opened it.
    pub fn close_session(&self, id: &str) -> Option<Caller> {
        let caller = self.session(id);
        self.lock_sessions().retain(|s| !s.id.matches(id));
        caller
    }

    /// Who opened the live session `id`, as their credential stands now.
    fn session(&self, id: &str) -> Option<Caller> {
        let now = std::time::Instant::now();
        let named = {
            let sessions = self.lock_sessions();
            match &sessions
                .iter()
                .find(|s| s.ends > now && s.id.matches(id))?
                .who
            {
                Opener::Jwt(caller) => return Some(caller.clone()),
                Opener::Named(name) => name.clone(),
            }
        };
        self.named_caller(&named)
    }

    fn lock_sessions(&self) -> std::sync::MutexGuard<'_, Vec<Session>> {
        self.sessions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// How many named credentials there are, beside the main token.
    pub fn named(&self) -> usize {
        self.credentials().len()
    }
}

fn caller_of(c: &Credential) -> Caller {
    Caller {
        name: c.name.clone(),
        tenant: c.tenant.clone(),
        roles: c.roles.clone(),
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
    /// The token presented is none of the node's, nor a JWT it takes: why.
    Refused(String),
    /// The session id could not be drawn (`/dev/urandom` failed): the
    /// node's fault, not the caller's.
    NoRandomness(std::io::Error),
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
    request: Request,
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
            Some(caller) => allowed(&tokens, caller, request, next).await,
            None => ApiError::unauthorized(
                "the console's session has ended (or this node restarted): log in again",
            )
            .into_response(),
        };
    }
    match presented.map(|p| tokens.identify(p)) {
        Some(Ok(caller)) => allowed(&tokens, caller, request, next).await,
        Some(Err(why)) => ApiError::unauthorized(why).into_response(),
        None => ApiError::unauthorized(
            "an `Authorization: Bearer TOKEN` header is required (the token is in the data dir's `token` file)",
        )
        .into_response(),
    }
}

/// Runs the request as `caller`'s: what it may see and do is decided next
/// (`tenancy::authorize`). A credential of a tenant arbor.toml does not
/// name is refused here.
async fn allowed(tokens: &Tokens, caller: Caller, mut request: Request, next: Next) -> Response {
    if let Some(audit) = request.extensions().get::<crate::audit::Audit>() {
        audit.caller(&caller);
    }
    if let Some(tenant) = &caller.tenant
        && !tokens.tenants.iter().any(|t| t == tenant)
    {
        return ApiError::unauthorized(format!(
            "the credential {:?} is of tenant {tenant}, which arbor.toml does not name \
             (its tenants: {})",
            caller.name,
            tokens.tenants.join(", ")
        ))
        .into_response();
    }
    request.extensions_mut().insert(caller);
    next.run(request).await
}

/// The role a route needs (I-63): reading is a viewer's; submitting,
/// stopping, steering, continuing and replaying an operator's; deciding a
/// card an approver's; the node an admin's. A route not named here is an
/// admin's: a new route is closed until it is placed.
pub fn required_role(method: &axum::http::Method, path: &str) -> credentials::Role {
    use credentials::Role;
    if method == axum::http::Method::GET || method == axum::http::Method::HEAD {
        return match path {
            "/v1/audit" | "/v1/tokens" => Role::Admin,
            _ => Role::Viewer,
        };
    }
    match path {
        "/v1/runs"
        | "/v1/runs/{id}/stop"
        | "/v1/runs/{id}/budget"
        | "/v1/runs/{id}/replay"
        | "/v1/jobs/{id}/stop"
        | "/v1/jobs/{id}/messages"
        | "/v1/jobs/{id}/continue"
        | "/v1/notifications/{id}/retry"
        | "/v1/schedules/{name}/pause"
        | "/v1/schedules/{name}/unpause"
        | "/v1/schedules/{name}/trigger"
        | "/v1/schedules/{name}/backfill" => Role::Operator,
        "/v1/approvals/{id}" => Role::Approver,
        _ => Role::Admin,
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
        let who = |tokens: &Tokens, t: &str| tokens.who(t).map(|c| c.name);
        let none = Tokens::load(dir.path(), main.clone()).unwrap();
        assert_eq!(none.named(), 0);
        assert_eq!(who(&none, main.as_str()).as_deref(), Some(MAIN_TOKEN_NAME));
        let path = dir.path().join(TOKENS_FILE);
        let alice = "a".repeat(40);
        let bob = "b".repeat(40);
        // The older form: read, each an admin of every tenant, and
        // rewritten with digests only.
        std::fs::write(
            &path,
            format!("# who decides\nalice {alice}\n\nbob {bob}\n"),
        )
        .unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let tokens = Tokens::load(dir.path(), main.clone()).unwrap();
        assert_eq!(who(&tokens, &alice).as_deref(), Some("alice"));
        assert_eq!(tokens.who(&bob).unwrap().roles, Roles::admin());
        assert_eq!(
            who(&tokens, main.as_str()).as_deref(),
            Some(MAIN_TOKEN_NAME)
        );
        assert_eq!(who(&tokens, &"c".repeat(40)), None);
        let kept = std::fs::read_to_string(&path).unwrap();
        assert!(!kept.contains(&alice) && kept.contains("sha256:"), "{kept}");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        for (text, why) in [
            (format!("alice {alice}\nalice {bob}\n"), "is taken"),
            (format!("operator {alice}\n"), "is taken"),
            (
                format!("alice {alice}\nbob {alice}\n"),
                "another credential's",
            ),
            ("alice short\n".to_string(), "too short"),
            (
                format!("al ice {alice}\n"),
                "expected `NAME sha256:HEX TENANT ROLES`",
            ),
            (format!("al/ice {alice}\n"), "not a credential's name"),
            (
                "alice sha256:00 default root\n".to_string(),
                "\"root\" is not a role",
            ),
            (
                "alice sha256:00 team/a viewer\n".to_string(),
                "is not a tenant's name",
            ),
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

    /// I-63: a credential made with `add` is known by its token at once (a
    /// running node reads the file again), with its roles; revoked, it is
    /// refused at the next request, its console session with it.
    #[test]
    fn inv_63_a_credential_added_is_taken_and_once_revoked_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (main, _) = Token::load_or_create(dir.path()).unwrap();
        let tokens = Tokens::load(dir.path(), main.clone()).unwrap();
        let (made, token) =
            credentials::add(dir.path(), main.as_str(), "dash", "default", "viewer").unwrap();
        assert_eq!(made.tenant.as_deref(), Some("default"));
        let caller = tokens.who(&token).expect("taken without a restart");
        assert_eq!(
            (caller.name.as_str(), caller.roles.names()),
            ("dash", vec!["viewer"])
        );
        let session = tokens.open_session(&token).unwrap();
        assert!(tokens.session(&session).is_some());
        let kept = std::fs::read_to_string(dir.path().join(TOKENS_FILE)).unwrap();
        assert!(!kept.contains(&token), "only its digest is kept");
        let again = credentials::add(dir.path(), main.as_str(), "dash", "*", "admin");
        assert!(again.unwrap_err().to_string().contains("already"));
        credentials::revoke(dir.path(), main.as_str(), "dash").unwrap();
        assert_eq!(tokens.who(&token), None);
        assert!(
            tokens.session(&session).is_none(),
            "its session ends with it"
        );
        assert!(credentials::revoke(dir.path(), main.as_str(), "dash").is_err());
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
