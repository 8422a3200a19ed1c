//! `/v1/tokens`: the node's named credentials (I-63), made, listed and
//! revoked by an admin through the API, as `arbor token` does on the data
//! dir. An admin of one tenant manages its own tenant's credentials only.
//! The change is the tokens file, not the journal: its audit entry follows
//! it, alone (I-64).

use super::common::{Reply, S, errors, json, secured};
use crate::Shared;
use crate::api::*;
use crate::credentials::{self, Caller};
use crate::error::ApiError;
use crate::extract::{JsonBody, Path};
use aide::axum::ApiRouter;
use aide::axum::routing::{delete_with, get_with};
use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use std::sync::Arc;

pub(super) fn token_routes() -> ApiRouter<Arc<Shared>> {
    ApiRouter::new()
        .api_route(
            "/v1/tokens",
            get_with(list_tokens, |op| {
                errors!(
                    secured(op)
                        .id("listTokens")
                        .summary("The named credentials: name, tenant, roles (admin)")
                        .description("Never a token: the node keeps only their SHA-256.")
                        .response::<200, Json<CredentialList>>(),
                    403,
                    503
                )
            })
            .post_with(add_token, |op| {
                errors!(
                    secured(op)
                        .id("addToken")
                        .summary("Make a named credential; its token is shown this once (admin)")
                        .response::<201, Json<CredentialMade>>(),
                    400,
                    403,
                    404,
                    409,
                    413,
                    415,
                    422,
                    503
                )
            }),
        )
        .api_route(
            "/v1/tokens/{id}",
            delete_with(revoke_token, |op| {
                errors!(
                    secured(op)
                        .id("revokeToken")
                        .summary(
                            "Revoke a named credential: refused from the next request on (admin)"
                        )
                        .response::<200, Json<CredentialView>>(),
                    403,
                    404,
                    503
                )
            }),
        )
}

fn refused_by_file(why: String) -> ApiError {
    ApiError::unavailable(format!("the tokens file: {why}"))
}

/// The credentials `caller` manages: every one, or its tenant's.
fn managed(shared: &Shared, caller: &Caller) -> Result<Vec<credentials::Credential>, ApiError> {
    let all = credentials::load(&shared.config.data_dir, shared.tokens.main().as_str())
        .map_err(refused_by_file)?
        .credentials;
    Ok(all
        .into_iter()
        .filter(|c| caller.tenant.is_none() || c.tenant == caller.tenant)
        .collect())
}

async fn list_tokens(State(shared): S, axum::Extension(caller): axum::Extension<Caller>) -> Reply {
    let credentials = managed(&shared, &caller)?
        .iter()
        .map(CredentialView::from)
        .collect();
    Ok(json(StatusCode::OK, CredentialList { credentials }))
}

async fn add_token(
    State(shared): S,
    axum::Extension(caller): axum::Extension<Caller>,
    axum::Extension(audit): axum::Extension<crate::audit::Audit>,
    JsonBody(body): JsonBody<NewCredential>,
) -> Reply {
    let tenant = match (&caller.tenant, body.tenant) {
        (Some(own), Some(named)) if *own != named => {
            audit.refused();
            return Err(ApiError::not_found(format!("no tenant {named}")));
        }
        (Some(own), _) => own.clone(),
        (None, Some(named)) => named,
        (None, None) => credentials::DEFAULT_TENANT.to_string(),
    };
    if tenant != "*" && !shared.workspace().tenant_names().contains(&tenant) {
        return Err(ApiError::refused(format!(
            "tenant {tenant} is not in arbor.toml (its tenants: {})",
            shared.workspace().tenant_names().join(", ")
        )));
    }
    let roles = body.roles.join(",");
    let (made, token) = credentials::add(
        &shared.config.data_dir,
        shared.tokens.main().as_str(),
        &body.name,
        &tenant,
        &roles,
    )
    .map_err(|e| match e {
        credentials::AddError::Taken(why) => ApiError::conflict(why),
        credentials::AddError::Invalid(why) => ApiError::refused(why),
        credentials::AddError::File(why) => refused_by_file(why),
    })?;
    let view = CredentialView::from(&made);
    Ok(json(
        StatusCode::CREATED,
        CredentialMade {
            name: view.name,
            tenant: view.tenant,
            roles: view.roles,
            token,
        },
    ))
}

async fn revoke_token(
    State(shared): S,
    axum::Extension(caller): axum::Extension<Caller>,
    axum::Extension(audit): axum::Extension<crate::audit::Audit>,
    Path(path): Path<IdPath>,
) -> Reply {
    let unknown = || ApiError::not_found(format!("no credential {}", path.id));
    let all = credentials::load(&shared.config.data_dir, shared.tokens.main().as_str())
        .map_err(refused_by_file)?
        .credentials;
    let Some(named) = all.iter().find(|c| c.name == path.id) else {
        return Err(unknown());
    };
    if caller.tenant.is_some() && named.tenant != caller.tenant {
        // Another tenant's reads as none; the audit says which it was.
        audit.refused();
        return Err(unknown());
    }
    let gone = credentials::revoke(
        &shared.config.data_dir,
        shared.tokens.main().as_str(),
        &path.id,
    )
    .map_err(|_| unknown())?;
    Ok(json(StatusCode::OK, CredentialView::from(&gone)))
}
