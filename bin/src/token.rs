//! `arbor token add|list|revoke`: a node's named credentials (I-63), made
//! and revoked offline on its data dir (`--data-dir`,
//! `arbor_service::credentials`; a running arbord reads the file again at
//! its next request), or, without it, through arbord's API as an admin.

use crate::client::{Failed, Outcome, Output, exit};
use arbor_service::credentials;
use clap::Subcommand;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Subcommand)]
pub enum TokenCommand {
    /// Make a credential: its token is printed once, alone on a line (the
    /// data dir keeps only its SHA-256).
    Add {
        /// Its name (letters, digits, `-`, `_`, `.`): what the audit and a
        /// card's decision record.
        name: String,
        /// Its tenant: one of arbor.toml's `[tenants]` (`default` without
        /// them), or `*` for every tenant; through the API, an admin of one
        /// tenant makes its own tenant's.
        #[arg(long)]
        tenant: Option<String>,
        /// Its roles, comma-separated: viewer, operator, approver, admin.
        #[arg(long)]
        roles: String,
        /// The node's data dir: made offline there; without it, through
        /// arbord's API (`--url`, `ARBOR_TOKEN`: an admin's).
        #[arg(long)]
        data_dir: Option<PathBuf>,
    },
    /// The credentials: name, tenant, roles (never a token).
    List {
        #[arg(long)]
        data_dir: Option<PathBuf>,
    },
    /// Revoke a credential: refused from the next request on.
    Revoke {
        name: String,
        #[arg(long)]
        data_dir: Option<PathBuf>,
    },
}

impl TokenCommand {
    /// The data dir it acts on offline; none: through the API.
    pub fn data_dir(&self) -> Option<&Path> {
        match self {
            TokenCommand::Add { data_dir, .. }
            | TokenCommand::List { data_dir }
            | TokenCommand::Revoke { data_dir, .. } => data_dir.as_deref(),
        }
    }
}

/// The same, through arbord's API as an admin.
pub async fn remote(client: &crate::client::Client, command: TokenCommand) -> Outcome {
    let shown = |c: &arbor_service::api::CredentialView| serde_json::json!({"name": c.name, "tenant": c.tenant, "roles": c.roles});
    match command {
        TokenCommand::Add {
            name,
            tenant,
            roles,
            ..
        } => {
            let new = arbor_service::api::NewCredential {
                name,
                tenant,
                roles: roles.split(',').map(|r| r.trim().to_string()).collect(),
            };
            let made = client
                .api
                .add_token(&new)
                .await
                .map_err(|e| client.failed(e))?;
            match client.output {
                Output::Text => println!("{}", made.token),
                _ => println!("{}", serde_json::to_string(&made).unwrap_or_default()),
            }
        }
        TokenCommand::List { .. } => {
            let list = client.api.tokens().await.map_err(|e| client.failed(e))?;
            match client.output {
                Output::Text => {
                    for c in &list.credentials {
                        println!(
                            "{}  tenant {}  roles {}",
                            c.name,
                            c.tenant,
                            c.roles.join(",")
                        );
                    }
                }
                Output::Json => {
                    let all: Vec<_> = list.credentials.iter().map(shown).collect();
                    println!("{}", serde_json::json!({ "credentials": all }));
                }
                Output::Jsonl => {
                    for c in &list.credentials {
                        println!("{}", shown(c));
                    }
                }
            }
        }
        TokenCommand::Revoke { name, .. } => {
            client
                .api
                .revoke_token(&name)
                .await
                .map_err(|e| client.failed(e))?;
            eprintln!("arbor: revoked {name}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The main token, if the data dir has one (no credential may be it).
fn main_token(data_dir: &Path) -> String {
    std::fs::read_to_string(data_dir.join(arbor_service::auth::TOKEN_FILE))
        .map(|t| t.trim().to_string())
        .unwrap_or_default()
}

fn refused(why: String) -> Failed {
    Failed::new(exit::USAGE, why)
}

fn view(c: &credentials::Credential) -> serde_json::Value {
    serde_json::json!({
        "name": c.name,
        "tenant": c.tenant.as_deref().unwrap_or("*"),
        "roles": c.roles.names(),
    })
}

pub fn run(command: TokenCommand, output: Output) -> Outcome {
    match command {
        TokenCommand::Add {
            name,
            tenant,
            roles,
            data_dir,
        } => {
            let data_dir = data_dir.unwrap_or_default();
            let tenant = tenant.unwrap_or_else(|| credentials::DEFAULT_TENANT.to_string());
            if !data_dir.is_dir() {
                return Err(refused(format!(
                    "{}: no data dir here (--data-dir names arbord's)",
                    data_dir.display()
                )));
            }
            let main = main_token(&data_dir);
            let (made, token) = credentials::add(&data_dir, &main, &name, &tenant, &roles)
                .map_err(|e| refused(e.to_string()))?;
            match output {
                Output::Text => println!("{token}"),
                _ => {
                    let mut shown = view(&made);
                    shown["token"] = token.into();
                    println!("{shown}");
                }
            }
        }
        TokenCommand::List { data_dir } => {
            let data_dir = data_dir.unwrap_or_default();
            let loaded = credentials::load(&data_dir, &main_token(&data_dir)).map_err(refused)?;
            match output {
                Output::Text => {
                    for c in &loaded.credentials {
                        println!(
                            "{}  tenant {}  roles {}",
                            c.name,
                            c.tenant.as_deref().unwrap_or("*"),
                            c.roles
                        );
                    }
                }
                Output::Json => {
                    let all: Vec<_> = loaded.credentials.iter().map(view).collect();
                    println!("{}", serde_json::json!({ "credentials": all }));
                }
                Output::Jsonl => {
                    for c in &loaded.credentials {
                        println!("{}", view(c));
                    }
                }
            }
        }
        TokenCommand::Revoke { name, data_dir } => {
            let data_dir = data_dir.unwrap_or_default();
            credentials::revoke(&data_dir, &main_token(&data_dir), &name).map_err(refused)?;
            eprintln!("arbor: revoked {name}");
        }
    }
    Ok(ExitCode::SUCCESS)
}
