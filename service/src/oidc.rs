//! Identities from an OIDC provider (I-63): `[auth.oidc]` in arbor.toml.
//! A bearer JWT is checked against the provider's keys (a JWKS file):
//! its signature, with the algorithm pinned to its key's (`alg: none` and
//! an HMAC algorithm against an RSA key are refused), `exp`, `nbf`, `iss`
//! and `aud`; then its claims give the caller's tenant and roles. Each
//! refusal says which check failed, never which key would have worked.
//!
//! ```toml
//! [auth.oidc]
//! issuer = "https://login.example.com/"
//! audience = "arbor"
//! jwks_file = "jwks.json"          # relative to the workspace
//! tenant_claim = "team"            # its value is the caller's tenant
//! roles_claim = "groups"           # role names, or mapped:
//! role_map = { "arbor-operators" = "operator", "arbor-viewers" = "viewer" }
//! ```

use crate::credentials::{Caller, DEFAULT_TENANT, Role, Roles};
use jsonwebtoken::jwk::{AlgorithmParameters, JwkSet};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// How far a clock may be off (`exp`, `nbf`).
const LEEWAY_SECS: u64 = 30;

/// `[auth.oidc]`, checked, with its keys.
#[derive(Clone)]
pub struct Oidc {
    issuer: String,
    audience: String,
    keys: JwkSet,
    tenant_claim: Option<String>,
    roles_claim: String,
    role_map: BTreeMap<String, Role>,
}

impl std::fmt::Debug for Oidc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Oidc")
            .field("issuer", &self.issuer)
            .field("audience", &self.audience)
            .field("keys", &self.keys.keys.len())
            .finish()
    }
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct OidcFile {
    issuer: String,
    audience: String,
    jwks_file: std::path::PathBuf,
    tenant_claim: Option<String>,
    roles_claim: String,
    #[serde(default)]
    role_map: BTreeMap<String, String>,
}

impl Oidc {
    /// `[auth.oidc]` from arbor.toml's `[auth]` table; `None` without it.
    /// `root`: the workspace, which a relative `jwks_file` is under.
    pub fn from_auth(auth: &toml::Table, root: &Path) -> Result<Option<Oidc>, String> {
        let Some(table) = auth.get("oidc") else {
            return Ok(None);
        };
        if let Some(other) = auth.keys().find(|k| *k != "oidc") {
            return Err(format!(
                "arbor.toml: auth.{other}: unknown key (auth takes oidc)"
            ));
        }
        let file: OidcFile = table
            .clone()
            .try_into()
            .map_err(|e| format!("arbor.toml: auth.oidc: {e}"))?;
        let path = root.join(&file.jwks_file);
        let text = std::fs::read_to_string(&path)
            .map_err(|e| format!("arbor.toml: auth.oidc.jwks_file: {}: {e}", path.display()))?;
        let keys: JwkSet = serde_json::from_str(&text).map_err(|e| {
            format!(
                "arbor.toml: auth.oidc.jwks_file: {}: not a JWKS: {e}",
                path.display()
            )
        })?;
        if keys.keys.is_empty() {
            return Err(format!(
                "arbor.toml: auth.oidc.jwks_file: {} holds no key",
                path.display()
            ));
        }
        let role_map = file
            .role_map
            .into_iter()
            .map(|(value, role)| {
                Role::parse(&role)
                    .map(|r| (value.clone(), r))
                    .map_err(|e| format!("arbor.toml: auth.oidc.role_map.{value:?}: {e}"))
            })
            .collect::<Result<_, _>>()?;
        Ok(Some(Oidc {
            issuer: file.issuer,
            audience: file.audience,
            keys,
            tenant_claim: file.tenant_claim,
            roles_claim: file.roles_claim,
            role_map,
        }))
    }

    /// The caller a bearer JWT stands for, or why it is refused.
    pub fn verify(&self, token: &str) -> Result<Caller, String> {
        self.verify_until(token).map(|(caller, _)| caller)
    }

    /// `verify`, and when the JWT expires (its `exp`, seconds since the
    /// epoch): a console session opened with it ends then at the latest.
    pub fn verify_until(&self, token: &str) -> Result<(Caller, u64), String> {
        let header = jsonwebtoken::decode_header(token)
            .map_err(|e| format!("the JWT's header does not read ({e}); `alg: none` is refused"))?;
        let jwk = match &header.kid {
            Some(kid) => self.keys.find(kid).ok_or_else(|| {
                format!("the JWT's key id {kid:?} is not one of the provider's keys")
            })?,
            None if self.keys.keys.len() == 1 => &self.keys.keys[0],
            None => {
                return Err("the JWT names no key id (kid), and the provider has several".into());
            }
        };
        let pinned = key_algorithm(jwk)?;
        if header.alg != pinned {
            return Err(format!(
                "the JWT's algorithm {:?} is not its key's ({pinned:?})",
                header.alg
            ));
        }
        let key = DecodingKey::from_jwk(jwk)
            .map_err(|e| format!("the provider's key does not read: {e}"))?;
        let mut validation = Validation::new(pinned);
        validation.set_issuer(&[&self.issuer]);
        validation.set_audience(&[&self.audience]);
        validation.set_required_spec_claims(&["exp", "iss", "aud", "sub"]);
        validation.validate_nbf = true;
        validation.leeway = LEEWAY_SECS;
        let data = jsonwebtoken::decode::<serde_json::Value>(token, &key, &validation)
            .map_err(|e| refusal(&e))?;
        let claims = data.claims;
        let subject = claims["sub"].as_str().unwrap_or_default().to_string();
        let tenant = match &self.tenant_claim {
            None => Some(DEFAULT_TENANT.to_string()),
            Some(claim) => {
                let value = claims[claim].as_str().ok_or_else(|| {
                    format!("the JWT has no {claim:?} claim (its tenant) as a string")
                })?;
                // Whether arbor.toml names it is asked of every caller alike.
                arbor_protocol::tenant::check_tenant_name(value)
                    .map_err(|why| format!("the JWT's {claim:?} claim: {why}"))?;
                Some(value.to_string())
            }
        };
        let values: Vec<String> = match &claims[&self.roles_claim] {
            serde_json::Value::Array(items) => items
                .iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect(),
            serde_json::Value::String(text) => {
                text.split_whitespace().map(str::to_string).collect()
            }
            _ => vec![],
        };
        let roles: BTreeSet<Role> = values
            .iter()
            .filter_map(|v| {
                self.role_map
                    .get(v)
                    .copied()
                    .or_else(|| Role::parse(v).ok())
            })
            .collect();
        let caller = Caller {
            name: subject,
            tenant,
            roles: Roles(roles),
        };
        Ok((caller, claims["exp"].as_u64().unwrap_or(0)))
    }
}

/// The algorithm a key is for: its own `alg`, else its family's
/// (RSA: RS256; EC P-256: ES256). A symmetric key is refused: arbor takes
/// only a provider's public keys.
fn key_algorithm(jwk: &jsonwebtoken::jwk::Jwk) -> Result<Algorithm, String> {
    if let Some(alg) = jwk.common.key_algorithm {
        let name = format!("{alg:?}");
        return name
            .parse::<Algorithm>()
            .map_err(|_| format!("the provider's key is for {name}, which arbor does not take"));
    }
    match &jwk.algorithm {
        AlgorithmParameters::RSA(_) => Ok(Algorithm::RS256),
        AlgorithmParameters::EllipticCurve(_) => Ok(Algorithm::ES256),
        AlgorithmParameters::OctetKeyPair(_) => Ok(Algorithm::EdDSA),
        AlgorithmParameters::OctetKey(_) => {
            Err("the provider's key is a shared secret: arbor takes public keys only".into())
        }
    }
}

/// Which check a JWT failed, in words.
fn refusal(e: &jsonwebtoken::errors::Error) -> String {
    use jsonwebtoken::errors::ErrorKind;
    match e.kind() {
        ErrorKind::ExpiredSignature => "the JWT has expired (exp)".into(),
        ErrorKind::ImmatureSignature => "the JWT is not valid yet (nbf)".into(),
        ErrorKind::InvalidIssuer => "the JWT's issuer (iss) is not the configured one".into(),
        ErrorKind::InvalidAudience => "the JWT's audience (aud) is not arbor's".into(),
        ErrorKind::InvalidSignature => "the JWT's signature does not verify".into(),
        ErrorKind::InvalidAlgorithm => "the JWT's algorithm is not its key's".into(),
        ErrorKind::MissingRequiredClaim(claim) => format!("the JWT has no {claim} claim"),
        other => format!("the JWT is refused: {other:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use jsonwebtoken::{EncodingKey, Header, encode};

    const ISSUER: &str = "https://login.example.com/";

    fn fixture(name: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/oidc")
            .join(name)
    }

    fn oidc() -> Oidc {
        let table: toml::Table = toml::from_str(&format!(
            "[oidc]\nissuer = \"{ISSUER}\"\naudience = \"arbor\"\njwks_file = \"{}\"\nroles_claim = \"groups\"\nrole_map = {{ \"arbor-ops\" = \"operator\" }}\n",
            fixture("jwks.json").display()
        ))
        .unwrap();
        Oidc::from_auth(&table, Path::new("/")).unwrap().unwrap()
    }

    fn now() -> i64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64
    }

    fn claims() -> serde_json::Value {
        serde_json::json!({
            "sub": "ada", "iss": ISSUER, "aud": "arbor",
            "exp": now() + 600, "nbf": now() - 10, "groups": ["arbor-ops", "viewer", "other"],
        })
    }

    fn signed(claims: &serde_json::Value, key: &str, header: Header) -> String {
        let pem = std::fs::read(fixture(key)).unwrap();
        encode(&header, claims, &EncodingKey::from_rsa_pem(&pem).unwrap()).unwrap()
    }

    fn rs256() -> Header {
        let mut header = Header::new(Algorithm::RS256);
        header.kid = Some("test-1".into());
        header
    }

    /// I-63: a good JWT maps to its subject and roles; each bad one is
    /// refused saying which check failed.
    #[test]
    fn inv_63_a_jwt_is_checked_and_each_bad_one_refused_with_its_reason() {
        let oidc = oidc();
        let caller = oidc
            .verify(&signed(&claims(), "test-rsa.pem", rs256()))
            .unwrap();
        assert_eq!(caller.name, "ada");
        assert_eq!(caller.roles.names(), ["viewer", "operator"]);
        let with = |key: &str, value: serde_json::Value| {
            let mut c = claims();
            c[key] = value;
            oidc.verify(&signed(&c, "test-rsa.pem", rs256()))
                .unwrap_err()
        };
        assert!(with("exp", (now() - 600).into()).contains("expired"));
        assert!(with("nbf", (now() + 600).into()).contains("not valid yet"));
        assert!(with("aud", "elsewhere".into()).contains("audience"));
        assert!(with("iss", "https://evil.example.com/".into()).contains("issuer"));
        let other = oidc
            .verify(&signed(&claims(), "other-rsa.pem", rs256()))
            .unwrap_err();
        assert!(other.contains("signature does not verify"), "{other}");
        let mut unknown = rs256();
        unknown.kid = Some("test-2".into());
        let e = oidc
            .verify(&signed(&claims(), "test-rsa.pem", unknown))
            .unwrap_err();
        assert!(
            e.contains("not one of the provider's keys") && !e.contains("test-1"),
            "{e}"
        );
        // `alg: none`, by hand: no library signs one.
        use base64::Engine as _;
        let b64 = |v: &serde_json::Value| {
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string())
        };
        let none = format!(
            "{}.{}.",
            b64(&serde_json::json!({"alg": "none", "typ": "JWT", "kid": "test-1"})),
            b64(&claims())
        );
        assert!(oidc.verify(&none).unwrap_err().contains("alg: none"));
        // HS256 with the RSA key's public bytes as its secret.
        let mut hs = Header::new(Algorithm::HS256);
        hs.kid = Some("test-1".into());
        let forged = encode(
            &hs,
            &claims(),
            &EncodingKey::from_secret(&std::fs::read(fixture("jwks.json")).unwrap()),
        )
        .unwrap();
        let e = oidc.verify(&forged).unwrap_err();
        assert!(e.contains("HS256") && e.contains("RS256"), "{e}");
    }
}
