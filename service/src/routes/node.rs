//! `/v1/node`, `/v1/nodes/{id}/drain` and `/metrics`: the node's own state.

use super::common::{Reply, S, errors, json, secured};
use crate::Shared;
use crate::api::*;
use crate::error::ApiError;
use crate::extract::Path;
use crate::status::*;
use aide::axum::ApiRouter;
use aide::axum::routing::{get_with, post_with};
use arbor_protocol::{RunId, Tree};
use axum::Json;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// The node: its status, a drain, its metrics.
pub(super) fn node_routes() -> ApiRouter<Arc<Shared>> {
    ApiRouter::new()
        .api_route(
            "/v1/status",
            get_with(node_status, |op| {
                errors!(
                    secured(op)
                        .id("status")
                        .summary("The node: live runs and their accounts, actors, sandboxes, queue, journal, last recovery")
                        .response::<200, Json<NodeStatus>>(),
                    503
                )
            }),
        )
        .api_route(
            "/v1/limits",
            get_with(limits, |op| {
                errors!(
                    secured(op)
                        .id("limits")
                        .summary("What this node throttles: each provider's rate windows (rpm, tpm) and each tenant's quota windows, their limits and what each holds now")
                        .response::<200, Json<Limits>>(),
                    503
                )
            }),
        )
        .api_route(
            "/v1/nodes/{id}/drain",
            post_with(drain_node, |op| {
                errors!(
                    secured(op)
                        .id("drainNode")
                        .summary("Drain a node of a shared journal: it takes no more runs, and its running ones finish or move")
                        .description(
                            "As SIGTERM to that node's arbord: queued runs stay in the shared \
                             queue, running ones get its `drain` time, then move to another \
                             node; it then exits 0. Another node learns it at its next lease \
                             renewal. A node whose journal is its own refuses (409): send \
                             its arbord SIGTERM.",
                        )
                        .response::<202, Json<DrainAsked>>(),
                    404,
                    409,
                    503
                )
            }),
        )
        .api_route(
            "/metrics",
            get_with(metrics, |op| {
                errors!(
                    secured(op)
                        .id("metrics")
                        .summary("Prometheus (OpenMetrics text) metrics; labels never name a run or job")
                        .response_with::<200, String, _>(|r| {
                            r.description("OpenMetrics text").with(|mut r| {
                                r.inner().content = [(
                                    "application/openmetrics-text".to_string(),
                                    aide::openapi::MediaType::default(),
                                )]
                                .into_iter()
                                .collect();
                                r
                            })
                        }),
                    503
                )
            }),
        )
}

async fn limits(
    State(shared): S,
    axum::Extension(caller): axum::Extension<crate::credentials::Caller>,
) -> Reply {
    let mut tenants = shared.admission.quotas().await;
    tenants.retain(|t| crate::tenancy::sees(&caller, &t.tenant));
    let mut concurrency = shared.admission.concurrency().await;
    concurrency.retain(|c| {
        c.key
            .strip_prefix("tenant:")
            .is_none_or(|tenant| crate::tenancy::sees(&caller, tenant))
    });
    let limits = Limits {
        models: shared.node.limits(),
        tenants,
        concurrency,
    };
    Ok(json(StatusCode::OK, &limits))
}

async fn node_status(
    State(shared): S,
    axum::Extension(caller): axum::Extension<crate::credentials::Caller>,
) -> Reply {
    let node = &shared.node;
    let journal = node.journal();
    let (queued, running) = shared.admission.counts().await?;
    let mut runs: Vec<arbor_protocol::TreeNode> = vec![];
    for sub in shared.admission.queued().await? {
        runs.push(Tree::new(sub.run).root());
    }
    for record in journal.runs()? {
        if !record.status.is_terminal()
            && let Some(tree) = node.events().tree(record.id)
            && !tree.run_status().is_terminal()
        {
            runs.push(tree.root());
        }
    }
    let recovery = node.recovery();
    let status = NodeStatus {
        node: NodeInfo {
            version: env!("CARGO_PKG_VERSION").into(),
            epoch: journal.epoch(),
            started_at_ms: shared.started_at_ms,
            uptime_ms: shared.started.elapsed().as_millis() as u64,
            accepting: shared.accepting.load(Ordering::SeqCst),
            sandbox: shared.node.sandbox(),
        },
        admission: AdmissionInfo {
            max_running_runs: shared.config.max_running_runs,
            running,
            queued,
        },
        journal: JournalInfo {
            applied_seq: journal.applied_seq(),
            durable_seq: journal.durable_seq(),
            flushes: journal.flush_count(),
            fsyncs: journal.sync_count(),
            failed: journal.failed(),
        },
        recovery: RecoveryInfo {
            epoch: recovery.epoch,
            jobs_failed: recovery.jobs_failed.clone(),
            processes_killed: recovery.processes_killed.clone(),
            grants_released: recovery.grants_released,
            runs_resumed: node.resumed().iter().map(|(id, _)| *id).collect(),
            undecodable: recovery.undecodable.len(),
            breaches: recovery.breaches.clone(),
        },
        runs,
        nodes: journal.nodes()?.map(|nodes| {
            nodes
                .into_iter()
                .map(|n| ClusterNode {
                    id: n.id,
                    epoch: n.epoch,
                    lease_left_ms: n.lease_left_ms,
                    runs: n
                        .runs
                        .into_iter()
                        .filter_map(|(key, epoch)| {
                            let run = uuid::Uuid::from_slice(&key).ok()?;
                            Some(OwnedRun {
                                run: RunId(run),
                                epoch,
                            })
                        })
                        .collect(),
                })
                .collect()
        }),
        actors: node.actors(),
        sandboxes: journal
            .live_sandboxes()?
            .into_iter()
            .map(|s| SandboxView {
                run: s.run,
                job: s.job,
                pgid: s.pgid,
            })
            .collect(),
    };
    Ok(json(StatusCode::OK, seen_by(&shared, &caller, status)?))
}

/// The node's status as a credential of one tenant sees it (I-63): its
/// own runs, jobs and sandboxes only; the node's figures as they are.
fn seen_by(
    shared: &Shared,
    caller: &crate::credentials::Caller,
    mut status: NodeStatus,
) -> Result<NodeStatus, ApiError> {
    use crate::tenancy::{retain_seen, sees_job, sees_run};
    if caller.tenant.is_none() {
        return Ok(status);
    }
    let sees = |run: RunId| sees_run(shared, caller, run);
    retain_seen(&mut status.runs, |r| match r.id.parse() {
        Ok(id) => sees(id),
        Err(_) => Ok(false),
    })?;
    let recovery = &mut status.recovery;
    retain_seen(&mut recovery.jobs_failed, |j| sees_job(shared, caller, *j))?;
    retain_seen(&mut recovery.runs_resumed, |r| sees(*r))?;
    // Which processes a restart killed, what broke, and the actors (named
    // by run and job) are the node's.
    recovery.processes_killed.clear();
    recovery.breaches.clear();
    status.actors.children.clear();
    retain_seen(&mut status.sandboxes, |s| sees(s.run))?;
    for node in status.nodes.iter_mut().flatten() {
        retain_seen(&mut node.runs, |owned| sees(owned.run))?;
    }
    Ok(status)
}

async fn drain_node(State(shared): S, Path(path): Path<NodePath>) -> Reply {
    let journal = shared.node.journal();
    let Some(me) = journal.node_id() else {
        return Err(ApiError::conflict(
            "this node's journal is its own, with no other node to take its runs: drain it \
             with SIGTERM to its arbord",
        ));
    };
    if path.id == me {
        shared.drain_asked.cancel();
        return Ok(json(
            StatusCode::ACCEPTED,
            DrainAsked {
                node: me,
                state: "draining".into(),
            },
        ));
    }
    match journal.ask_drain(&path.id)? {
        Some(true) => Ok(json(
            StatusCode::ACCEPTED,
            DrainAsked {
                node: path.id,
                state: "asked".into(),
            },
        )),
        _ => Err(ApiError::not_found(format!(
            "no node {:?} in this journal (`arbor status` lists them)",
            path.id
        ))),
    }
}

async fn metrics(
    State(shared): S,
    axum::Extension(caller): axum::Extension<crate::credentials::Caller>,
) -> Reply {
    let (queued, _) = shared.admission.counts().await?;
    shared
        .metrics
        .set_tenants(&crate::tenancy::runs_by_tenant(&shared)?);
    shared.metrics.set_limits(&shared.node.limits());
    shared.metrics.set_quotas(&shared.admission.quotas().await);
    shared
        .metrics
        .set_concurrency(&shared.admission.concurrency().await);
    let text = shared
        .metrics
        .render(
            shared.node.journal(),
            queued,
            shared.node.telemetry(),
            shared.node.notifications(),
        )
        .map_err(|e| ApiError::unavailable(format!("metrics: {e}")))?;
    // A credential of one tenant sees its tenant's figures only (I-63).
    let text = match &caller.tenant {
        Some(tenant) => crate::metrics::for_tenant(&text, tenant),
        None => text,
    };
    Ok((
        StatusCode::OK,
        [(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)],
        text,
    )
        .into_response())
}
