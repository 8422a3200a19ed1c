//! I-37: the node's bearer token. Made on first start as a 0600 file in the
//! data dir; every route but `/healthz` and `/readyz` refuses a request
//! without it. Compared in constant time, so the time a refusal takes says
//! nothing of how much of a guess was right.

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

fn random_hex(bytes: usize) -> std::io::Result<String> {
    let mut buf = vec![0u8; bytes];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut buf)?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// The middleware on every protected route.
pub async fn require_token(
    axum::extract::State(token): axum::extract::State<Token>,
    request: Request,
    next: Next,
) -> Response {
    let presented = request
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match presented {
        Some(p) if token.matches(p) => next.run(request).await,
        Some(_) => ApiError::unauthorized("the bearer token is wrong").into_response(),
        None => ApiError::unauthorized(
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
    fn inv_37_a_token_file_others_can_read_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (_, path) = Token::load_or_create(dir.path()).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = Token::load_or_create(dir.path()).unwrap_err();
        assert!(err.contains("0600"), "{err}");
    }
}
