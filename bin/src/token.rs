//! `arbor token add|list|revoke`: a node's named credentials (I-63), made
//! and revoked offline on its data dir (`arbor_service::credentials`). A
//! running arbord reads the file again at its next request.

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
        /// Its tenant: `default` (the one there is without [tenants]) or
        /// `*` for every tenant.
        #[arg(long, default_value = credentials::DEFAULT_TENANT)]
        tenant: String,
        /// Its roles, comma-separated: viewer, operator, approver, admin.
        #[arg(long)]
        roles: String,
        /// The node's data dir.
        #[arg(long, default_value = ".arbor")]
        data_dir: PathBuf,
    },
    /// The credentials: name, tenant, roles (never a token).
    List {
        #[arg(long, default_value = ".arbor")]
        data_dir: PathBuf,
    },
    /// Revoke a credential: refused from the next request on.
    Revoke {
        name: String,
        #[arg(long, default_value = ".arbor")]
        data_dir: PathBuf,
    },
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
            if !data_dir.is_dir() {
                return Err(refused(format!(
                    "{}: no data dir here (--data-dir names arbord's)",
                    data_dir.display()
                )));
            }
            let main = main_token(&data_dir);
            let (made, token) =
                credentials::add(&data_dir, &main, &name, &tenant, &roles).map_err(refused)?;
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
            credentials::revoke(&data_dir, &main_token(&data_dir), &name).map_err(refused)?;
            eprintln!("arbor: revoked {name}");
        }
    }
    Ok(ExitCode::SUCCESS)
}
