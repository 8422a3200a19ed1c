//! Deploys (I-67): which workspace version new runs and schedules take.
//! A reload (SIGHUP, `POST /v1/workspace/reload`) reads the files and
//! checks them whole before anything changes; a rollback makes a version
//! the journal keeps current again. Either keeps the version in the
//! journal first (`EmbeddedNode::deploy`), then swaps what is deployed:
//! a run admitted before keeps its own version to its end.
//!
//! arbor.toml is the node's (its providers, journal, limits, tenants and
//! service settings are read once, at start): a reload or a rollback to a
//! version whose arbor.toml differs is refused, naming it; a restart
//! applies it.

use crate::api::Deployment;
use crate::error::ApiError;
use crate::{Shared, StartError};
use arbor_runtime::{EmbeddedNode, Workspace, versions};
use std::collections::BTreeMap;
use std::sync::Arc;

/// What new runs take now: a workspace version, and its triggers' keys.
pub struct Deployed {
    pub workspace: Arc<Workspace>,
    /// `[triggers.NAME]`'s signing keys, by trigger.
    pub trigger_keys: BTreeMap<String, Vec<u8>>,
}

impl Deployed {
    fn of(workspace: Workspace) -> Result<Deployed, String> {
        let trigger_keys = arbor_runtime::secrets::load(&workspace).and_then(|secrets| {
            arbor_runtime::triggers::keys(&workspace.config.triggers, &secrets)
        })?;
        Ok(Deployed {
            workspace: Arc::new(workspace),
            trigger_keys,
        })
    }
}

/// At start: the files on disk, unless a rollback made another version
/// current while the files were these (a restart keeps that rollback; an
/// edit since is a deploy of its own).
pub async fn at_start(node: &EmbeddedNode, disk: Workspace) -> Result<Deployed, StartError> {
    let journal = node.journal();
    let rolled_back = match versions::current(journal)? {
        Some((id, files_then)) if files_then == disk.version && id != disk.version => {
            match versions::files(journal, &id)?.map(|files| disk.from_snapshot(&files)) {
                Some(Ok(earlier)) => Some(earlier),
                Some(Err(e)) => {
                    tracing::warn!(version = %id, error = %e, "the version made current no longer loads: the files are deployed");
                    None
                }
                None => None,
            }
        }
        _ => None,
    };
    let disk_version = disk.version.clone();
    let chosen = rolled_back.unwrap_or(disk);
    // A rollback the edited files overrule is retired; with none, the
    // files are current and nothing is written.
    if versions::current(journal)?.is_some_and(|(id, _)| id != chosen.version) {
        let row = versions::current_row(journal, &chosen.version, &disk_version)?;
        journal.commit(vec![row]).await?;
    }
    tracing::info!(version = %chosen.version, "workspace version");
    Deployed::of(chosen).map_err(StartError::Token)
}

/// Reads the workspace's files again and deploys them, if they load.
pub(crate) async fn reload(shared: &Shared) -> Result<Deployment, ApiError> {
    let _one = shared.deploy_lock.lock().await;
    let now = shared.workspace();
    let disk = Workspace::load(&now.root).map_err(|e| {
        ApiError::refused(format!(
            "the workspace does not load; version {} stays current: {e}",
            now.version
        ))
    })?;
    let disk_version = disk.version.clone();
    switch(shared, disk, &disk_version).await
}

/// Makes version `id`, which the journal keeps, current again.
pub(crate) async fn rollback(shared: &Shared, id: &str) -> Result<Deployment, ApiError> {
    let _one = shared.deploy_lock.lock().await;
    let journal = shared.node.journal();
    let files = versions::files(journal, id)?
        .ok_or_else(|| ApiError::not_found(format!("no workspace version {id}")))?;
    let now = shared.workspace();
    let earlier = now.from_snapshot(&files).map_err(|e| {
        ApiError::refused(format!(
            "version {id} does not load here; version {} stays current: {e}",
            now.version
        ))
    })?;
    // What the files are now: a restart on them keeps this rollback.
    let disk = Workspace::load(&now.root)
        .map(|w| w.version)
        .unwrap_or_default();
    switch(shared, earlier, &disk).await
}

async fn switch(shared: &Shared, mut next: Workspace, disk: &str) -> Result<Deployment, ApiError> {
    let previous = shared.workspace();
    // What the start added to arbor.toml's journal settings (the node's id).
    next.config.journal = previous.config.journal.clone();
    if next.files.get("arbor.toml") != previous.files.get("arbor.toml") {
        return Err(ApiError::refused(format!(
            "arbor.toml differs from the running one's: it is read at start (restart arbord to apply it); version {} stays current",
            previous.version
        )));
    }
    let deployed = Deployed::of(next).map_err(ApiError::refused)?;
    shared
        .node
        .deploy(&deployed.workspace)
        .await
        .map_err(|e| ApiError::unavailable(e.to_string()))?;
    let journal = shared.node.journal();
    let version = deployed.workspace.version.clone();
    journal
        .commit(vec![versions::current_row(journal, &version, disk)?])
        .await?;
    *shared.deployed.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(deployed);
    tracing::info!(%version, previous = %previous.version, "workspace deployed");
    Ok(Deployment {
        changed: version != previous.version,
        version,
        previous: previous.version.clone(),
    })
}
