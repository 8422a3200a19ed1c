//! Delegation and admission. A delegate call is checked whole against the
//! caps before anything is reserved, so a refused call changes nothing (I-04,
//! I-06); the same key and request again returns the jobs it started (I-32).
//! Admission reserves every grant in one message, and the delegation and its
//! jobs are durable before any child starts (I-29); a child that cannot start
//! has its hold released and its record marked failed (I-06).

use super::children::{ChildEntry, ChildState, FanOut, PlannedChild};
use super::messages::{Brief, JobMsg};
use super::{
    DEFAULT_MAX_TURNS, Job, JobStart, JobState, Lineage, MAX_RETRIES, RESERVED_KEY_PREFIX,
};
use crate::account::{AccountMsg, FirstCall, Grant, GrantAsk, Share, SpentMeter};
use crate::agent_loop::ChildHandle;
use crate::model::Model;
use arbor_protocol::tools::parse_duration_arg;
use arbor_protocol::{
    Amount, DelegateArgs, ErrorClass, EventKind, JobId, NodeKind, ParentRef, Refusal, SandboxMode,
    Status,
};
use arbor_storage::{DelegationRecord, JobRecord, Record};
use ractor::{Actor, ActorRef};
use std::path::PathBuf;
use std::sync::Arc;

/// What a parent makes for a child at its admission (`JobState::prepare`).
#[derive(Default)]
pub(super) struct Prepared {
    model: Option<Arc<dyn Model>>,
    first_call: Option<FirstCall>,
}

impl JobState {
    pub(super) async fn delegate(
        &mut self,
        myself: &ActorRef<JobMsg>,
        args: DelegateArgs,
        call_id: &str,
    ) -> Result<Vec<ChildHandle>, Refusal> {
        if self.finish.is_some() {
            return Err(Refusal::Stopping);
        }
        let limits = &self.ctx.limits;
        if self.lineage.depth >= limits.depth {
            return Err(Refusal::DepthCap {
                depth: self.lineage.depth,
                cap: limits.depth,
            });
        }
        let asked = args.jobs.len() as u32;
        if asked == 0 {
            return Err(Refusal::BadArguments {
                tool: "delegate".into(),
                message: "jobs is empty".into(),
            });
        }
        if asked > limits.fan_out {
            return Err(Refusal::FanOutCap {
                asked,
                cap: limits.fan_out,
            });
        }
        let running = self.children.running_count();
        if running + asked > limits.running_children {
            return Err(Refusal::RunningChildrenCap {
                running,
                asked,
                cap: limits.running_children,
            });
        }
        // I-32: the same key and request again returns the jobs it started.
        let key = match &args.key {
            Some(k)
                if k.trim().is_empty() || k.len() > 200 || k.starts_with(RESERVED_KEY_PREFIX) =>
            {
                return Err(Refusal::BadArguments {
                    tool: "delegate".into(),
                    message: format!(
                        "key must be 1 to 200 characters and not start with {RESERVED_KEY_PREFIX:?}"
                    ),
                });
            }
            Some(k) => k.clone(),
            None => format!("{}:{call_id}", self.lineage.id),
        };
        let digest = delegation_digest(&args);
        if let Some(existing) = self.existing_delegation(&key, &digest)? {
            return Ok(existing);
        }
        let group = self.children.groups.len();
        let mut planned = Vec::with_capacity(args.jobs.len());
        for (i, job) in args.jobs.iter().enumerate() {
            let plan = self.plan_child(job, i, &planned, args.wait, group, call_id)?;
            planned.push(plan);
        }
        self.run_ctx.count_spawns(planned.len() as u64)?;
        tracing::debug!(run = %self.lineage.run, job = %self.lineage.id, children = planned.len(), "delegation admitted by the caps");
        let result = self.admit(myself, planned, &key, &digest).await;
        match result {
            Ok(handles) => {
                self.children.groups.push(FanOut {
                    on_failure: args.on_failure,
                });
                Ok(handles)
            }
            Err((refusal, unstarted)) => {
                self.run_ctx.uncount_spawns(unstarted);
                Err(refusal)
            }
        }
    }

    /// The handles of a delegation already made under `key`, if its request
    /// was the same; a conflict if it was not; None if the key is new.
    fn existing_delegation(
        &self,
        key: &str,
        digest: &str,
    ) -> Result<Option<Vec<ChildHandle>>, Refusal> {
        let record = self
            .ctx
            .journal
            .delegation(self.lineage.id, key)
            .map_err(|e| Refusal::Invalid {
                message: format!("the journal could not be read: {e}"),
            })?;
        let Some(record) = record else {
            return Ok(None);
        };
        if record.digest != digest {
            return Err(Refusal::KeyConflict {
                key: key.to_string(),
            });
        }
        let handles = record
            .children
            .iter()
            .filter_map(|id| self.children.by_id.get(id))
            .map(|c| ChildHandle {
                label: c.label.clone(),
                id: c.id,
                agent: c.agent.clone(),
                grant_tokens: c.grant.tokens,
                grant_usd_micros: c.grant.usd_micros,
            })
            .collect();
        Ok(Some(handles))
    }

    /// Checks one job of a delegate call and resolves it; pure but for lookups.
    fn plan_child(
        &self,
        job: &arbor_protocol::JobArgs,
        index: usize,
        planned: &[PlannedChild],
        wait: bool,
        group: usize,
        call_id: &str,
    ) -> Result<PlannedChild, Refusal> {
        let bad = |message: String| Refusal::BadArguments {
            tool: "delegate".into(),
            message: format!("jobs[{index}]: {message}"),
        };
        if !self.agent.subagents.iter().any(|s| s == &job.agent) {
            return Err(Refusal::NotASubagent {
                agent: job.agent.clone(),
                parent: self.agent.name.clone(),
                allowed: self.agent.subagents.join(", "),
            });
        }
        let Some(agent) = self.ctx.agent(&job.agent) else {
            return Err(bad(format!("no agent {:?} on this node", job.agent)));
        };
        let agent = on_model(agent, job.model.as_deref()).map_err(bad)?;
        if job.request.trim().is_empty() {
            return Err(bad("request is empty".into()));
        }
        let label = match &job.label {
            Some(l) => {
                if l.trim().is_empty() || l.len() > 64 || l.contains('/') {
                    return Err(bad(format!(
                        "label {l:?} must be 1 to 64 characters without `/`"
                    )));
                }
                l.clone()
            }
            None => self.children.auto_label(&job.agent, planned.len()),
        };
        if self.children.latest.contains_key(&label) || planned.iter().any(|p| p.label == label) {
            return Err(Refusal::DuplicateLabel { label });
        }
        let budget_refused = |message: String| Refusal::Budget {
            message: format!("jobs[{index}]: {message}"),
        };
        let (asked, asked_usd_micros) = match &job.budget {
            Some(b) => (
                b.tokens().map_err(budget_refused)?,
                b.usd_micros().map_err(budget_refused)?,
            ),
            None => (None, None),
        };
        let max_turns = match job.max_turns {
            Some(n) if !(1..=10_000).contains(&n) => {
                return Err(bad(format!("max_turns must be 1 to 10000, got {n}")));
            }
            Some(n) => n as u32,
            None => agent.max_turns.unwrap_or(DEFAULT_MAX_TURNS),
        };
        let timeout = parse_duration_arg("timeout", job.timeout.as_deref())
            .map_err(bad)?
            .or(agent.timeout)
            // I-59: every job has a cap.
            .or(Some(self.ctx.limits.job_timeout));
        let retries = match job.retries {
            None => 0,
            Some(n) if n < 0 => {
                return Err(bad(format!("retries must be 0 to {MAX_RETRIES}, got {n}")));
            }
            Some(n) => (n as u32).min(MAX_RETRIES),
        };
        if let Some(policy) = &job.retry {
            if job.retries.is_some() {
                return Err(bad(
                    "give retries or retry, not both: retry is retries with waits".into(),
                ));
            }
            policy.check().map_err(bad)?;
        }
        let tries_again = retries > 0 || job.retry.as_ref().is_some_and(|p| p.attempts > 1);
        if tries_again && !wait {
            return Err(bad(
                "retries need wait = true: a job is retried only while its caller waits".into(),
            ));
        }
        if let Some(schema) = &job.output_schema {
            jsonschema::validator_for(schema)
                .map_err(|e| bad(format!("output_schema is not a valid JSON Schema: {e}")))?;
        }
        for pattern in &job.require_artifacts {
            glob::Pattern::new(pattern)
                .map_err(|e| bad(format!("require_artifacts {pattern:?}: {e}")))?;
        }
        let policy = self.policy.narrow(&agent, &job.deny);
        Ok(PlannedChild {
            call: std::sync::Arc::from(call_id),
            id: JobId::new(),
            label,
            asked,
            asked_usd_micros,
            brief: Brief {
                request: job.request.clone(),
                max_turns,
                timeout,
                output_schema: job.output_schema.clone(),
                require_artifacts: job.require_artifacts.clone(),
            },
            policy,
            agent,
            retries,
            retry: job.retry.clone().map(std::sync::Arc::new),
            attempt: 1,
            group,
        })
    }

    /// Reserves every grant in one message, journals the delegation, starts
    /// the children. Returns the refusal and how many spawns never started.
    async fn admit(
        &mut self,
        myself: &ActorRef<JobMsg>,
        planned: Vec<PlannedChild>,
        key: &str,
        digest: &str,
    ) -> Result<Vec<ChildHandle>, (Refusal, u64)> {
        let total = planned.len() as u64;
        let asks: Vec<GrantAsk> = planned
            .iter()
            .map(|p| GrantAsk {
                child: p.id,
                agent: p.agent.name.clone(),
                asked: p.asked,
                agent_max: p.agent.budget_tokens,
                asked_usd_micros: p.asked_usd_micros,
                agent_max_usd_micros: p.agent.budget_usd_micros,
            })
            .collect();
        let share = Share::Fraction(self.ctx.limits.grant_fraction);
        let grants = match ractor::call!(self.account, |reply| AccountMsg::Reserve {
            asks,
            share,
            reply
        }) {
            Ok(Ok(grants)) => grants,
            Ok(Err(refusal)) => return Err((refusal, total)),
            Err(e) => {
                return Err((
                    Refusal::Invalid {
                        message: format!("the account did not answer: {e}"),
                    },
                    total,
                ));
            }
        };
        // I-29: the delegation and its jobs are durable before any child starts.
        let epoch = self.ctx.journal.epoch();
        let mut records = vec![Record::Delegation(DelegationRecord {
            parent: self.lineage.id,
            key: key.to_string(),
            digest: digest.to_string(),
            children: planned.iter().map(|p| p.id).collect(),
            epoch,
        })];
        let mut first_calls = Vec::with_capacity(planned.len());
        for (plan, grant) in planned.iter().zip(&grants) {
            records.push(Record::Job(self.child_record(
                plan,
                *grant,
                Status::Pending,
            )));
            // Each child's account opened and its first call reserved in
            // this same commit, where that call can be known.
            let (prepared, opened) = self.prepare(plan, *grant, epoch);
            records.extend(opened);
            first_calls.push(prepared);
        }
        let record_seq = match self.ctx.journal.commit(records).await {
            Ok(seq) => seq,
            Err(e) => {
                for (plan, _) in planned.iter().zip(&grants) {
                    let _ = ractor::call!(self.account, |reply| AccountMsg::Settle {
                        child: plan.id,
                        spent: Amount::ZERO,
                        reply
                    });
                }
                return Err((
                    Refusal::Invalid {
                        message: format!("the journal could not record the delegation: {e}"),
                    },
                    total,
                ));
            }
        };
        let mut handles = vec![];
        let mut unstarted = 0;
        let mut first_failure = None;
        for ((plan, grant), prepared) in planned.into_iter().zip(grants).zip(first_calls) {
            match self
                .spawn_child(myself, &plan, grant, record_seq, prepared)
                .await
            {
                Ok(handle) => handles.push(handle),
                Err(why) => {
                    unstarted += 1;
                    first_failure.get_or_insert(why);
                }
            }
        }
        if let Some(why) = first_failure {
            if handles.is_empty() {
                return Err((Refusal::Invalid { message: why }, unstarted));
            }
            self.run_ctx.uncount_spawns(unstarted);
        }
        Ok(handles)
    }

    /// A child's model, and its first model call with the ledger records
    /// that open its account and reserve it, for its admission's commit
    /// (`account::FirstCall`), where the parent can know that call: not
    /// for a job that may start MCP servers, whose tools are listed only
    /// once it runs. A recording job wraps this model in its recorder; a
    /// replaying one answers from its recording, whose counts are this
    /// model's, and uses the held call if it asks for the same.
    fn prepare(&self, plan: &PlannedChild, grant: Grant, epoch: u64) -> (Prepared, Vec<Record>) {
        let none = (Prepared::default(), vec![]);
        if plan.policy.may_use_mcp() {
            return none;
        }
        let Ok(model) = self.ctx.models.model_for(&plan.agent) else {
            // The child's start says why, as it would have.
            return none;
        };
        let offered = plan.policy.offered(
            &plan.agent,
            NodeKind::Job,
            self.lineage.depth + 1,
            &self.ctx.limits,
        );
        let skills = crate::skills::listed(&self.ctx.skills, &plan.agent, &plan.policy);
        let call = crate::agent_loop::first_call(
            model.as_ref(),
            &plan.agent,
            &offered,
            &self.ctx,
            &skills,
            &plan.brief.request,
            self.run_ctx.instructions.as_deref(),
        );
        let (first_call, opened) =
            match FirstCall::plan(plan.id, grant, self.ctx.limits.wind_down, epoch, &call) {
                Some((first, opened)) => (Some(first), opened),
                None => (None, vec![]),
            };
        let prepared = Prepared {
            model: Some(model),
            first_call,
        };
        (prepared, opened)
    }

    pub(super) fn child_record(
        &self,
        plan: &PlannedChild,
        grant: Grant,
        status: Status,
    ) -> JobRecord {
        JobRecord {
            id: plan.id,
            run: self.lineage.run,
            parent: ParentRef::Job(self.lineage.id),
            kind: NodeKind::Job,
            agent: plan.agent.name.clone(),
            label: Some(plan.label.clone()),
            depth: self.lineage.depth + 1,
            attempt: plan.attempt,
            grant_tokens: grant.tokens,
            workdir: self.child_workdir(plan).display().to_string(),
            status,
            task_status: None,
            error_class: None,
            reason: None,
            output_json: "null".into(),
            tokens_spent: 0,
            epoch: self.ctx.journal.epoch(),
        }
    }

    fn child_workdir(&self, plan: &PlannedChild) -> PathBuf {
        let leaf = format!("{}-{}", plan.label, plan.attempt);
        match plan.agent.sandbox {
            // I-28: a job's default workdir is its own: a fresh folder below the parent's.
            SandboxMode::Shared => self.workdir.join("jobs").join(leaf),
            SandboxMode::Own => self
                .ctx
                .work_root
                .join(self.lineage.run.to_string())
                .join("own")
                .join(plan.id.to_string()),
        }
    }

    /// Starts one admitted child. On failure its hold is released and its
    /// record marked failed, so nothing is left running or held (I-06).
    pub(super) async fn spawn_child(
        &mut self,
        myself: &ActorRef<JobMsg>,
        plan: &PlannedChild,
        grant: Grant,
        record_seq: u64,
        prepared: Prepared,
    ) -> Result<ChildHandle, String> {
        let meter = SpentMeter::default();
        let start = JobStart {
            payer: None,
            ctx: self.ctx.clone(),
            run_ctx: self.run_ctx.clone(),
            lineage: Lineage {
                id: plan.id,
                run: self.lineage.run,
                parent: ParentRef::Job(self.lineage.id),
                kind: NodeKind::Job,
                depth: self.lineage.depth + 1,
                attempt: plan.attempt,
                label: Some(plan.label.clone()),
                path: self
                    .lineage
                    .path
                    .iter()
                    .cloned()
                    .chain([plan.label.clone()])
                    .collect(),
                key: crate::tape::lineage_key(Some(&self.lineage.key), &plan.label, plan.attempt),
                call: Some(plan.call.clone()),
            },
            agent: plan.agent.clone(),
            brief: plan.brief.clone(),
            policy: plan.policy.clone(),
            grant,
            workdir: self.child_workdir(plan),
            parent: myself.get_derived(),
            cancel: self.cancel.child_token(),
            meter: meter.clone(),
            record_seq,
            tool_counts: Default::default(),
            first_call: prepared.first_call,
            model: prepared.model,
            peers: None,
        };
        let name = format!("arbor-job-{}", plan.id);
        match Actor::spawn_linked(Some(name), Job, start, myself.get_cell()).await {
            Ok((actor, _)) => {
                self.children.insert(ChildEntry {
                    id: plan.id,
                    label: plan.label.clone(),
                    agent: plan.agent.name.clone(),
                    attempt: plan.attempt,
                    actor,
                    grant,
                    meter,
                    state: ChildState::Running,
                    stop_reason: None,
                    envelope: None,
                    plan: plan.clone(),
                    retries_left: plan.retries,
                    collected: false,
                });
                Ok(ChildHandle {
                    label: plan.label.clone(),
                    id: plan.id,
                    agent: plan.agent.name.clone(),
                    grant_tokens: grant.tokens,
                    grant_usd_micros: grant.usd_micros,
                })
            }
            Err(e) => {
                let why = format!("{} could not start: {e}", plan.label);
                let _ = ractor::call!(self.account, |reply| AccountMsg::Settle {
                    child: plan.id,
                    spent: Amount::ZERO,
                    reply
                });
                let mut record = self.child_record(plan, grant, Status::Failed);
                record.error_class = Some(ErrorClass::Start);
                record.reason = Some(why.clone());
                let _ = self.ctx.journal.commit(vec![Record::Job(record)]).await;
                self.ctx.events.emit(
                    self.lineage.run,
                    EventKind::Refused {
                        id: self.lineage.id,
                        tool: "delegate".into(),
                        refusal: Refusal::Invalid {
                            message: why.clone(),
                        },
                    },
                );
                Err(why)
            }
        }
    }
}

/// The digest of a delegate call's canonical request (I-32): its JSON with
/// sorted keys, without the key itself, hashed with SHA-256, in lower-case
/// hex. serde_json's objects keep their keys sorted (its `preserve_order`
/// feature is off in this workspace), so the JSON of the request's value
/// is already canonical; a test pins the digest of one request, and would
/// fail were that to change.
pub fn delegation_digest(args: &DelegateArgs) -> String {
    use sha2::{Digest, Sha256};
    let mut canonical = serde_json::to_value(args).unwrap_or_default();
    if let Some(map) = canonical.as_object_mut() {
        map.remove("key");
    }
    let json = serde_json::to_vec(&canonical).unwrap_or_default();
    const HEX: &[u8; 16] = b"0123456789abcdef";
    Sha256::digest(&json)
        .iter()
        .flat_map(|b| [HEX[usize::from(b >> 4)], HEX[usize::from(b & 15)]])
        .map(char::from)
        .collect()
}

/// `agent` as a job of it runs on `model` (I-55): one of the models it
/// allows, named as `provider/model`; its default when none is named.
fn on_model(
    agent: std::sync::Arc<arbor_protocol::AgentDef>,
    model: Option<&str>,
) -> Result<std::sync::Arc<arbor_protocol::AgentDef>, String> {
    let Some(name) = model.map(str::trim) else {
        return Ok(agent);
    };
    let allowed = agent.allowed_models();
    match allowed.iter().find(|m| m.to_string() == name) {
        Some(m) if *m == agent.model => Ok(agent),
        Some(m) => Ok(std::sync::Arc::new(arbor_protocol::AgentDef {
            model: m.clone(),
            ..(*agent).clone()
        })),
        None => Err(format!(
            "model {name:?} is not one agent {:?} may run on; name one of: {}",
            agent.name,
            allowed
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A digest is journaled with its delegation and compared after a
    /// restart (I-32), so the same request must hash the same across
    /// builds: pinned here, with keys given out of order, a nested schema
    /// and the key itself (which the digest leaves out).
    #[test]
    fn the_digest_of_a_request_is_stable_and_ignores_the_key() {
        let args: DelegateArgs = serde_json::from_value(serde_json::json!({
            "key": "k1",
            "wait": false,
            "jobs": [
                {"request": "find it", "agent": "researcher", "label": "a",
                 "output_schema": {"type": "object", "required": ["b", "a"]}},
                {"agent": "writer", "request": "write it", "retries": 1}
            ],
            "on_failure": "cancel_siblings"
        }))
        .unwrap();
        let digest = delegation_digest(&args);
        assert_eq!(
            digest,
            "8148e9f72f817ac40ca94d3acc800c5b518a4ed991572447426bf536795e1fa7"
        );
        let mut other_key = args.clone();
        other_key.key = Some("k2".into());
        assert_eq!(delegation_digest(&other_key), digest);
        let mut other_request = args;
        other_request.jobs[1].request = "write it again".into();
        assert_ne!(delegation_digest(&other_request), digest);
    }
}
