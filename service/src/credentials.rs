//! Named credentials (I-63): the data dir's `tokens` file, each line a
//! credential's name, its token's SHA-256 (never the token), its tenant
//! (`*`: every tenant) and its roles:
//!
//! ```text
//! dashboard sha256:9f86d0...  default  viewer
//! ci        sha256:2c26b4...  *        operator,approver
//! ```
//!
//! A file in the older `NAME TOKEN` form is read, each token an admin of
//! every tenant (what it could do before), and rewritten hashed. Made and
//! revoked offline (`arbor token add|list|revoke`); a running arbord reads
//! the file again when it changes, so a revocation holds at the next request.
//!
//! Tokens are 32 random bytes, so one SHA-256 is enough: there is nothing
//! to guess that a slow hash would protect.

use sha2::{Digest, Sha256};
use std::collections::BTreeSet;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// The named credentials' file in the data dir.
pub const TOKENS_FILE: &str = "tokens";
/// The name the main token decides under (an admin of every tenant).
pub const MAIN_TOKEN_NAME: &str = "operator";

pub use arbor_protocol::DEFAULT_TENANT;

/// What a credential may do (I-63). A role above `viewer` may also read;
/// `admin` may do all.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    /// Read: runs, jobs, events, cards, status, metrics.
    Viewer,
    /// Submit, stop, steer, continue, replay; send a notification again.
    Operator,
    /// Decide and answer cards.
    Approver,
    /// The node: drain, credentials, audit.
    Admin,
}

impl Role {
    pub const ALL: [Role; 4] = [Role::Viewer, Role::Operator, Role::Approver, Role::Admin];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Viewer => "viewer",
            Role::Operator => "operator",
            Role::Approver => "approver",
            Role::Admin => "admin",
        }
    }

    pub fn parse(text: &str) -> Result<Role, String> {
        Role::ALL
            .into_iter()
            .find(|r| r.as_str() == text)
            .ok_or_else(|| format!("{text:?} is not a role: viewer, operator, approver or admin"))
    }
}

/// A credential's roles.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Roles(pub BTreeSet<Role>);

impl Roles {
    /// Every role: the main token's, and an old-format token's.
    pub fn admin() -> Roles {
        Roles(BTreeSet::from([Role::Admin]))
    }

    /// Whether these roles allow what `need` allows.
    pub fn allow(&self, need: Role) -> bool {
        self.0.contains(&Role::Admin)
            || self.0.contains(&need)
            || (need == Role::Viewer && !self.0.is_empty())
    }

    /// `viewer,operator` as written.
    pub fn parse(text: &str) -> Result<Roles, String> {
        let roles: BTreeSet<Role> = text
            .split(',')
            .map(str::trim)
            .filter(|r| !r.is_empty())
            .map(Role::parse)
            .collect::<Result<_, _>>()?;
        if roles.is_empty() {
            return Err("name at least one role: viewer, operator, approver or admin".into());
        }
        Ok(Roles(roles))
    }

    pub fn names(&self) -> Vec<&'static str> {
        self.0.iter().map(|r| r.as_str()).collect()
    }
}

impl std::fmt::Display for Roles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.names().join(","))
    }
}

/// Who a request comes from (a request extension): the credential's name
/// (`operator` for the main token; a JWT's subject), its tenant (`None`:
/// every tenant) and its roles.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    pub name: String,
    pub tenant: Option<String>,
    pub roles: Roles,
}

/// One named credential, as the file keeps it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Credential {
    pub name: String,
    /// `sha256:` and the hex of its token's digest.
    pub hash: String,
    /// Its tenant; `None`: every tenant.
    pub tenant: Option<String>,
    pub roles: Roles,
}

/// A token's digest, as the file keeps it.
pub fn digest(token: &str) -> String {
    let sum = Sha256::digest(token.as_bytes());
    let hex: String = sum.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

fn check_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{name:?} is not a credential's name: up to 64 letters, digits, `-`, `_` or `.`"
        ))
    }
}

/// A tenant as written (`*`: every tenant). Whether arbor.toml names it is
/// arbord's to check: the file is written offline, without it.
fn parse_tenant(text: &str) -> Result<Option<String>, String> {
    if text == "*" {
        return Ok(None);
    }
    arbor_protocol::tenant::check_tenant_name(text)?;
    Ok(Some(text.to_string()))
}

/// What `load` found.
pub struct Loaded {
    pub credentials: Vec<Credential>,
    /// Old-format lines read (each an admin of every tenant) and rewritten
    /// hashed.
    pub rewritten: usize,
}

/// Reads `<data_dir>/tokens` (none: no credentials). It must be 0600; each
/// line `NAME sha256:HEX TENANT ROLES`, or the older `NAME TOKEN`, which is
/// rewritten hashed. `main` is the main token, which no credential may be.
pub fn load(data_dir: &Path, main: &str) -> Result<Loaded, String> {
    let path = data_dir.join(TOKENS_FILE);
    let shown = path.display();
    let text = match std::fs::metadata(&path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(Loaded {
                credentials: vec![],
                rewritten: 0,
            });
        }
        Err(e) => return Err(format!("{shown}: {e}")),
        Ok(meta) if meta.permissions().mode() & 0o077 != 0 => {
            return Err(format!(
                "{shown}: mode {:o} lets others read the tokens; make it 0600 (chmod 600)",
                meta.permissions().mode() & 0o777
            ));
        }
        Ok(_) => std::fs::read_to_string(&path).map_err(|e| format!("{shown}: {e}"))?,
    };
    let main_hash = digest(main);
    let mut credentials: Vec<Credential> = vec![];
    let mut rewritten = 0;
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let at = |why: String| format!("{shown} line {}: {why}", n + 1);
        let parts: Vec<&str> = line.split_whitespace().collect();
        let credential = match parts.as_slice() {
            [name, hash, tenant, roles] if hash.starts_with("sha256:") => Credential {
                name: name.to_string(),
                hash: hash.to_string(),
                tenant: parse_tenant(tenant).map_err(at)?,
                roles: Roles::parse(roles).map_err(at)?,
            },
            [name, token] if !token.starts_with("sha256:") => {
                if token.len() < 32 {
                    return Err(at(format!(
                        "the token of {name} is too short (at least 32 characters)"
                    )));
                }
                rewritten += 1;
                Credential {
                    name: name.to_string(),
                    hash: digest(token),
                    tenant: None,
                    roles: Roles::admin(),
                }
            }
            _ => {
                return Err(at(
                    "expected `NAME sha256:HEX TENANT ROLES` (or the older `NAME TOKEN`)".into(),
                ));
            }
        };
        check_name(&credential.name).map_err(at)?;
        if credential.name == MAIN_TOKEN_NAME
            || credentials.iter().any(|c| c.name == credential.name)
        {
            return Err(at(format!("the name {:?} is taken", credential.name)));
        }
        if credential.hash == main_hash || credentials.iter().any(|c| c.hash == credential.hash) {
            return Err(at(format!(
                "the token of {} is another credential's too",
                credential.name
            )));
        }
        credentials.push(credential);
    }
    if rewritten > 0 {
        write(data_dir, &credentials)?;
    }
    Ok(Loaded {
        credentials,
        rewritten,
    })
}

/// Writes the file whole, 0600, through a temporary file renamed over it.
fn write(data_dir: &Path, credentials: &[Credential]) -> Result<(), String> {
    let path = data_dir.join(TOKENS_FILE);
    let temporary = data_dir.join(format!("{TOKENS_FILE}.new"));
    let mut text =
        String::from("# arbor's named credentials: NAME sha256:HEX TENANT ROLES (`arbor token`)\n");
    for c in credentials {
        text.push_str(&format!(
            "{} {} {} {}\n",
            c.name,
            c.hash,
            c.tenant.as_deref().unwrap_or("*"),
            c.roles
        ));
    }
    let fail = |e: std::io::Error| format!("{}: {e}", temporary.display());
    let _ = std::fs::remove_file(&temporary);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&temporary)
        .map_err(fail)?;
    file.write_all(text.as_bytes())
        .and_then(|()| file.sync_all())
        .map_err(fail)?;
    std::fs::rename(&temporary, &path).map_err(|e| format!("{}: {e}", path.display()))
}

/// `bytes` random bytes, as hex.
pub(crate) fn random_hex(bytes: usize) -> std::io::Result<String> {
    use std::io::Read;
    let mut buf = vec![0u8; bytes];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut buf)?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// Why a credential was not added; nothing changed.
#[derive(Debug, thiserror::Error)]
pub enum AddError {
    /// A bad name, tenant or roles.
    #[error("{0}")]
    Invalid(String),
    /// The name is another credential's.
    #[error("{0}")]
    Taken(String),
    /// The tokens file (or the randomness) failed: the node's trouble.
    #[error("{0}")]
    File(String),
}

/// Adds the credential `name`: its token, made here and returned once (the
/// file keeps only its digest).
pub fn add(
    data_dir: &Path,
    main: &str,
    name: &str,
    tenant: &str,
    roles: &str,
) -> Result<(Credential, String), AddError> {
    check_name(name).map_err(AddError::Invalid)?;
    if name == MAIN_TOKEN_NAME {
        return Err(AddError::Invalid(format!(
            "the name {name:?} is the main token's"
        )));
    }
    let tenant = parse_tenant(tenant).map_err(AddError::Invalid)?;
    let roles = Roles::parse(roles).map_err(AddError::Invalid)?;
    let mut credentials = load(data_dir, main).map_err(AddError::File)?.credentials;
    if credentials.iter().any(|c| c.name == name) {
        return Err(AddError::Taken(format!(
            "there is a credential {name:?} already: revoke it first (`arbor token revoke {name}`)"
        )));
    }
    let token = random_hex(32).map_err(|e| AddError::File(format!("/dev/urandom: {e}")))?;
    let credential = Credential {
        name: name.to_string(),
        hash: digest(&token),
        tenant,
        roles,
    };
    credentials.push(credential.clone());
    write(data_dir, &credentials).map_err(AddError::File)?;
    Ok((credential, token))
}

/// Revokes the credential `name`.
pub fn revoke(data_dir: &Path, main: &str, name: &str) -> Result<Credential, String> {
    let mut credentials = load(data_dir, main)?.credentials;
    let Some(at) = credentials.iter().position(|c| c.name == name) else {
        return Err(format!("there is no credential {name:?}"));
    };
    let gone = credentials.remove(at);
    write(data_dir, &credentials)?;
    Ok(gone)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_allow_reading_to_all_and_everything_to_an_admin() {
        let operator = Roles::parse("operator").unwrap();
        assert!(operator.allow(Role::Viewer) && operator.allow(Role::Operator));
        assert!(!operator.allow(Role::Approver) && !operator.allow(Role::Admin));
        let viewer = Roles::parse("viewer").unwrap();
        assert!(viewer.allow(Role::Viewer) && !viewer.allow(Role::Operator));
        assert!(Role::ALL.into_iter().all(|r| Roles::admin().allow(r)));
        assert!(Roles::parse("").is_err());
        assert!(
            Roles::parse("viewer,root")
                .unwrap_err()
                .contains("\"root\" is not a role")
        );
    }
}
