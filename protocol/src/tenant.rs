//! Tenants (I-63): the teams that share one node. Every run belongs to
//! one; while arbor.toml names none, that is `default`.

/// The tenant of every run while arbor.toml has no `[tenants]`, and of a
/// run whose spec names none.
pub const DEFAULT_TENANT: &str = "default";

/// A tenant's name as arbor.toml, a credential and a metric label take it:
/// 1 to 64 letters, digits, `-`, `_` or `.`.
pub fn check_tenant_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{name:?} is not a tenant's name: 1 to 64 letters, digits, `-`, `_` or `.`"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_name_is_plain() {
        assert!(check_tenant_name("team-a.eu_1").is_ok());
        for bad in ["", "a b", "a/b", "*", &"x".repeat(65)] {
            assert!(check_tenant_name(bad).is_err(), "{bad:?}");
        }
    }
}
