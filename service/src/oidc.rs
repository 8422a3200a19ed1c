//! Identities from an OIDC provider (I-63): `[auth.oidc]` in arbor.toml.
//! A bearer JWT is checked against the provider's keys (a JWKS: a file, or
//! its URL, fetched at start, every `jwks_refresh` and when a JWT names a
//! key id it does not hold, at most once a `MIN_REFETCH`):
//! its signature, with the algorithm pinned to its key's (`alg: none` and
//! an HMAC algorithm against an RSA key are refused), `exp`, `nbf`, `iss`
//! and `aud`; then its claims give the caller's tenant and roles. Each
//! refusal says which check failed, never which key would have worked.
//!
//! ```toml
//! [auth.oidc]
//! issuer = "https://login.example.com/"
//! audience = "arbor"
//! jwks_file = "jwks.json"          # relative to the workspace; or
//! # jwks_url = "https://login.example.com/.well-known/jwks.json"
//! tenant_claim = "team"            # its value is the caller's tenant
//! roles_claim = "groups"           # role names, or mapped:
//! role_map = { "arbor-operators" = "operator", "arbor-viewers" = "viewer" }
//! ```

use crate::credentials::{Caller, DEFAULT_TENANT, Role, Roles};
use jsonwebtoken::jwk::{AlgorithmParameters, Jwk, JwkSet};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// How far a clock may be off (`exp`, `nbf`).
const LEEWAY_SECS: u64 = 30;
/// How often a `jwks_url` is fetched again when `jwks_refresh` does not say.
const DEFAULT_REFRESH: Duration = Duration::from_secs(15 * 60);
/// The least time between two fetches an unknown key id asks for: JWTs
/// with made-up key ids cannot make arbord hammer its provider.
const MIN_REFETCH: Duration = Duration::from_secs(30);
/// How long one fetch of the keys may take.
const FETCH_TIMEOUT: Duration = Duration::from_secs(10);

/// `[auth.oidc]`, checked, with its keys.
#[derive(Clone)]
pub struct Oidc {
    issuer: String,
    audience: String,
    keys: Arc<RwLock<JwkSet>>,
    /// `jwks_url`, and how often it is fetched again; none for a file.
    url: Option<(String, Duration)>,
    /// Woken when a JWT names a key id the keys lack (a provider's new key).
    unknown_kid: Arc<tokio::sync::Notify>,
    /// Counts the fetches that replaced the keys.
    fetched: Arc<tokio::sync::watch::Sender<u64>>,
    tenant_claim: Option<String>,
    roles_claim: String,
    role_map: BTreeMap<String, Role>,
}

impl std::fmt::Debug for Oidc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Oidc")
            .field("issuer", &self.issuer)
            .field("audience", &self.audience)
            .field("keys", &self.read_keys().keys.len())
            .field("url", &self.url)
            .finish()
    }
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct OidcFile {
    issuer: String,
    audience: String,
    jwks_file: Option<std::path::PathBuf>,
    jwks_url: Option<String>,
    jwks_refresh: Option<String>,
    tenant_claim: Option<String>,
    roles_claim: String,
    #[serde(default)]
    role_map: BTreeMap<String, String>,
}

/// A JWKS as fetched or read, checked: JSON of a key set with a key.
fn parse_keys(text: &str, from: &str) -> Result<JwkSet, String> {
    let keys: JwkSet =
        serde_json::from_str(text).map_err(|e| format!("{from}: not a JWKS: {e}"))?;
    if keys.keys.is_empty() {
        return Err(format!("{from} holds no key"));
    }
    Ok(keys)
}

/// `jwks_url` checked: https, or http to this machine (a provider run
/// beside arbord, or a test's).
fn check_url(url: &str) -> Result<(), String> {
    let parsed = reqwest::Url::parse(url).map_err(|e| format!("{url:?} is not a URL: {e}"))?;
    let local = matches!(
        parsed.host_str(),
        Some("localhost" | "127.0.0.1" | "[::1]" | "::1")
    );
    match parsed.scheme() {
        "https" => Ok(()),
        "http" if local => Ok(()),
        other => Err(format!(
            "{url:?}: the provider's keys are fetched over https (http only from this \
             machine), not {other}"
        )),
    }
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
        let (keys, url) = match (&file.jwks_file, &file.jwks_url) {
            (Some(file), None) => {
                let path = root.join(file);
                let text = std::fs::read_to_string(&path).map_err(|e| {
                    format!("arbor.toml: auth.oidc.jwks_file: {}: {e}", path.display())
                })?;
                let from = format!("arbor.toml: auth.oidc.jwks_file: {}", path.display());
                (parse_keys(&text, &from)?, None)
            }
            (None, Some(url)) => {
                check_url(url).map_err(|e| format!("arbor.toml: auth.oidc.jwks_url: {e}"))?;
                let refresh = match &file.jwks_refresh {
                    None => DEFAULT_REFRESH,
                    Some(text) => humantime::parse_duration(text)
                        .ok()
                        .filter(|d| *d >= Duration::from_secs(60))
                        .ok_or_else(|| {
                            format!(
                                "arbor.toml: auth.oidc.jwks_refresh: {text:?} is not a \
                                 duration of a minute or more"
                            )
                        })?,
                };
                // Fetched by `fetch`, before the node takes requests.
                (JwkSet { keys: vec![] }, Some((url.clone(), refresh)))
            }
            _ => {
                return Err(
                    "arbor.toml: auth.oidc: give the provider's keys as jwks_file or \
                     jwks_url (one of them)"
                        .into(),
                );
            }
        };
        if file.jwks_refresh.is_some() && url.is_none() {
            return Err("arbor.toml: auth.oidc.jwks_refresh goes with jwks_url".into());
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
            keys: Arc::new(RwLock::new(keys)),
            url,
            unknown_kid: Arc::default(),
            fetched: Arc::new(tokio::sync::watch::channel(0).0),
            tenant_claim: file.tenant_claim,
            roles_claim: file.roles_claim,
            role_map,
        }))
    }

    fn read_keys(&self) -> std::sync::RwLockReadGuard<'_, JwkSet> {
        self.keys
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Fetches `jwks_url` now (nothing for a file): the keys are replaced
    /// only by a good set, so a provider that is down keeps the last.
    pub async fn fetch(&self) -> Result<(), String> {
        let Some((url, _)) = &self.url else {
            return Ok(());
        };
        let fetched = async {
            let response = reqwest::Client::new()
                .get(url)
                .timeout(FETCH_TIMEOUT)
                .send()
                .await
                .map_err(|e| e.to_string())?;
            if !response.status().is_success() {
                return Err(format!("it answered {}", response.status()));
            }
            response.text().await.map_err(|e| e.to_string())
        };
        let text = fetched
            .await
            .map_err(|e| format!("the provider's keys ({url}): {e}"))?;
        let keys = parse_keys(&text, url)?;
        *self
            .keys
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = keys;
        self.fetched.send_modify(|n| *n += 1);
        Ok(())
    }

    /// Keeps a `jwks_url`'s keys fresh until `stop`: every `jwks_refresh`,
    /// and when a JWT named a key id they lack (at most every `MIN_REFETCH`).
    pub async fn refresh(self, stop: tokio_util::sync::CancellationToken) {
        let Some((_, every)) = self.url.clone() else {
            return;
        };
        let mut last_asked: Option<std::time::Instant> = None;
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(every) => {}
                () = self.unknown_kid.notified() => {
                    if let Some(wait) = last_asked
                        .map(|at| MIN_REFETCH.saturating_sub(at.elapsed()))
                        .filter(|wait| !wait.is_zero())
                    {
                        tokio::select! {
                            () = stop.cancelled() => return,
                            () = tokio::time::sleep(wait) => {}
                        }
                    }
                    last_asked = Some(std::time::Instant::now());
                }
            }
            if let Err(why) = self.fetch().await {
                tracing::warn!(%why, "the OIDC provider's keys were not fetched; keeping the last");
            }
        }
    }

    /// Changes after each fetch that replaced the keys.
    pub fn fetched(&self) -> tokio::sync::watch::Receiver<u64> {
        self.fetched.subscribe()
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
        let jwk: Jwk = {
            let keys = self.read_keys();
            match &header.kid {
                Some(kid) => match keys.find(kid) {
                    Some(jwk) => jwk.clone(),
                    None => {
                        // The provider may have a new key: look again.
                        self.unknown_kid.notify_one();
                        return Err(format!(
                            "the JWT's key id {kid:?} is not one of the provider's keys"
                        ));
                    }
                },
                None if keys.keys.len() == 1 => keys.keys[0].clone(),
                None if keys.keys.is_empty() => {
                    self.unknown_kid.notify_one();
                    return Err("the provider's keys have not been fetched yet".into());
                }
                None => {
                    return Err(
                        "the JWT names no key id (kid), and the provider has several".into(),
                    );
                }
            }
        };
        let jwk = &jwk;
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

    /// The keys come from one place, a file or a URL fetched over https
    /// (http only from this machine); each mistake is named at load.
    #[test]
    fn the_keys_are_a_file_or_a_url_and_each_mistake_is_named() {
        let load = |keys: &str| {
            let text = format!(
                "[oidc]\nissuer = \"{ISSUER}\"\naudience = \"arbor\"\nroles_claim = \"groups\"\n{keys}"
            );
            let table: toml::Table = toml::from_str(&text).unwrap();
            Oidc::from_auth(&table, Path::new("/")).map(|o| o.is_some())
        };
        for (keys, why) in [
            ("", "give the provider's keys as jwks_file or jwks_url"),
            (
                "jwks_file = \"a.json\"\njwks_url = \"https://x/\"",
                "(one of them)",
            ),
            ("jwks_url = \"http://login.example.com/jwks\"", "over https"),
            ("jwks_url = \"not a url\"", "is not a URL"),
            (
                "jwks_url = \"https://login.example.com/jwks\"\njwks_refresh = \"5s\"",
                "a minute or more",
            ),
        ] {
            let err = load(keys).unwrap_err();
            assert!(err.contains(why), "{keys}: {err}");
        }
        assert_eq!(load("jwks_url = \"http://127.0.0.1:1/jwks\""), Ok(true));
        assert_eq!(
            load("jwks_url = \"https://login.example.com/jwks\""),
            Ok(true)
        );
    }
}
