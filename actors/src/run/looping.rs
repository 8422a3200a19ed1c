//! A step's loop (`until`): after each iteration that ends done, a check
//! decides (a command in the step's sandbox, a pattern on its output, or a
//! judge's job); on revise the step runs again, told its previous output
//! and the issues, within the loop's bounds. Each check is journaled and
//! durable before the next iteration or the step's end, so a restart
//! resumes the loop at its iteration (I-56).

use super::checks::{Found, Left, LoopState, command_found, verdict_of};
use super::{Failed, PlannedStep, Role, RunMsg, RunState};
use crate::policy::Policy;
use crate::sandbox::{GroupRecorder, Sandbox, SandboxArgs, SandboxMsg};
use arbor_protocol::{
    ErrorClass, EventKind, JobId, JudgeVerdict, ResultEnvelope, Status, StepSpec, Until,
};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::time::Duration;

impl RunState {
    /// The loop of the step `label` of the current group, if it loops.
    pub(super) fn until(&self, label: &str) -> Option<Until> {
        self.step_spec(label)?.until.clone()
    }

    /// The loop's state, begun now if it has none.
    pub(super) fn loop_of(&mut self, label: &str) -> &mut LoopState {
        self.loops
            .entry(label.to_string())
            .or_insert_with(|| LoopState {
                iteration: 1,
                since_ms: crate::events::now_ms(),
                ..LoopState::default()
            })
    }

    /// What the loop's bounds leave for its next job, or which is spent.
    pub(super) fn loop_left(&mut self, label: &str) -> Result<Left, String> {
        let Some(until) = self.until(label) else {
            return Ok(Left::default());
        };
        let state = self.loop_of(label).clone();
        let tokens = until
            .max_tokens
            .map(|most| most.saturating_sub(state.spent.tokens));
        if let (Some(0), Some(most)) = (tokens, until.max_tokens) {
            return Err(format!(
                "its iterations spent until.max_tokens ({most} tokens)"
            ));
        }
        let usd_micros = until
            .max_usd_micros()
            .map(|most| most.saturating_sub(state.spent.usd_micros));
        if usd_micros == Some(0) {
            return Err(format!(
                "its iterations spent until.max_usd ({} dollars)",
                until.max_usd.unwrap_or_default()
            ));
        }
        let time = until.max_time().map(|most| {
            let end = state.since_ms.saturating_add(most.as_millis() as u64);
            Duration::from_millis(end.saturating_sub(crate::events::now_ms()))
        });
        if time.is_some_and(|t| t.is_zero()) {
            return Err(format!(
                "until.max_time ({}) has passed since its first iteration started",
                until.max_time.unwrap_or_default()
            ));
        }
        Ok(Left {
            tokens,
            usd_micros,
            time,
        })
    }

    /// An iteration's request: the step's, and after the first, the
    /// previous iteration's output and what its check found.
    pub(super) fn loop_request(&self, label: &str, instruction: &str) -> String {
        let (Some(until), Some(state)) = (self.until(label), self.loops.get(label)) else {
            return instruction.to_string();
        };
        let Some((output, issues)) = &state.previous else {
            return instruction.to_string();
        };
        let mut text = format!(
            "{instruction}\n\nThis is iteration {} of at most {}: the previous iteration's \
             output did not pass its check. Its output was:\n{output}\n\nWhat the check found:",
            state.iteration,
            until.max_iterations()
        );
        if issues.is_empty() {
            text.push_str("\n- it did not pass (no issues were given)");
        }
        for issue in issues {
            text.push_str(&format!("\n- {issue}"));
        }
        text
    }

    /// What a loop's job of `label` spent, its iteration's or its judge's.
    pub(super) fn loop_spent(&mut self, label: &str, envelope: &ResultEnvelope) {
        if self.until(label).is_none() {
            return;
        }
        let state = self.loop_of(label);
        state.spent.tokens = state.spent.tokens.saturating_add(envelope.tokens_spent);
        state.spent.usd_micros = state
            .spent
            .usd_micros
            .saturating_add(envelope.usd_micros_spent);
    }

    /// An iteration of `label` ended done: its check starts. The group is
    /// not over until it has decided.
    pub(super) async fn check_iteration(
        &mut self,
        myself: &ActorRef<RunMsg>,
        label: String,
        envelope: ResultEnvelope,
    ) -> Result<(), ActorProcessingErr> {
        let Some(until) = self.until(&label) else {
            return Ok(());
        };
        self.checking.insert(label.clone(), envelope.job);
        if let Some(pattern) = &until.pattern {
            let text = match &envelope.output {
                serde_json::Value::String(text) => text.clone(),
                other => other.to_string(),
            };
            let found = match regex::Regex::new(pattern) {
                Ok(re) if re.is_match(&text) => Found {
                    passed: true,
                    verdict: None,
                    issues: vec![],
                    failed: None,
                },
                Ok(_) => Found {
                    passed: false,
                    verdict: None,
                    issues: vec![format!("the output does not match the pattern {pattern:?}")],
                    failed: None,
                },
                Err(e) => Found::failed(format!("until.pattern does not compile: {e}")),
            };
            return self
                .iteration_checked(myself, label, envelope.job, found)
                .await;
        }
        if let Some(command) = until.command.clone() {
            self.check_command(myself, label, &envelope, command);
            return Ok(());
        }
        if let Some(judge) = until.judge.clone() {
            return self.start_judge(myself, label, judge, &envelope).await;
        }
        Ok(())
    }

    /// Runs the loop's command in the step's sandbox (its agent's
    /// resources, network and secrets) and workdir, as a task that reports
    /// back (`RunMsg::Checked`): exit 0 passes.
    fn check_command(
        &mut self,
        myself: &ActorRef<RunMsg>,
        label: String,
        envelope: &ResultEnvelope,
        command: String,
    ) {
        let job = envelope.job;
        let run = myself.clone();
        let Some(step) = self.step_spec(&label).cloned() else {
            return;
        };
        let Some(agent) = self.ctx.agent(&step.agent) else {
            let found = Found::failed(format!("unknown agent {:?}", step.agent));
            let _ = run.cast(RunMsg::Checked { label, job, found });
            return;
        };
        let left = self.loop_left(&label).unwrap_or_default();
        let policy = Policy::root(&agent, &self.ctx.limits, &self.ctx.approvals.tools);
        let env = match self.ctx.secrets.env_for(&policy.secrets) {
            Ok(env) => env,
            Err(e) => {
                let found = Found::failed(format!("its check could not be given its secrets: {e}"));
                let _ = run.cast(RunMsg::Checked { label, job, found });
                return;
            }
        };
        let timeout = left.time.map_or(self.ctx.limits.job_timeout, |t| {
            t.min(self.ctx.limits.job_timeout)
        });
        let args = SandboxArgs {
            record: Some(GroupRecorder {
                journal: self.ctx.journal.clone(),
                events: self.ctx.events.clone(),
                run: self.id,
                job,
            }),
            workdir: std::path::PathBuf::from(&envelope.workdir),
            cancel: self.cancel.child_token(),
            exec_timeout: timeout,
            resources: agent.resources,
            network: policy.network,
            posture: self.ctx.sandbox.clone(),
            runs_commands: true,
            env,
            secrets: self.ctx.secrets.clone(),
            roots: Some(self.ctx.sandbox_roots.clone()),
        };
        let cell = myself.get_cell();
        tracing::info!(run = %self.id, step = %label, command, "a loop's check runs");
        tokio::spawn(async move {
            let found = match Actor::spawn_linked(None, Sandbox, args, cell).await {
                Err(e) => Found::failed(format!("its check's sandbox could not start: {e}")),
                Ok((sandbox, _)) => {
                    let outcome = ractor::call!(sandbox, |reply| SandboxMsg::Exec {
                        command: command.clone(),
                        timeout: Some(timeout),
                        reply,
                    });
                    sandbox.stop(None);
                    match outcome {
                        Err(e) => Found::failed(format!("its check's sandbox is gone: {e}")),
                        Ok(outcome) => command_found(&command, outcome),
                    }
                }
            };
            let _ = run.cast(RunMsg::Checked { label, job, found });
        });
    }

    /// Starts the loop's judge on the iteration's output: a run-level job
    /// (`LABEL.judge`), its grant and time within the loop's bounds, that
    /// answers through the verdict's schema.
    async fn start_judge(
        &mut self,
        myself: &ActorRef<RunMsg>,
        label: String,
        judge: String,
        envelope: &ResultEnvelope,
    ) -> Result<(), ActorProcessingErr> {
        let worker = envelope.job;
        let left = match self.loop_left(&label) {
            Ok(left) => left,
            Err(why) => {
                let found = Found::failed(format!("before its judge could run, {why}"));
                return self.iteration_checked(myself, label, worker, found).await;
            }
        };
        let Some(agent) = self.ctx.agent(&judge) else {
            let found = Found::failed(format!("unknown judge agent {judge:?}"));
            return self.iteration_checked(myself, label, worker, found).await;
        };
        let step = self.step_spec(&label).cloned();
        let request = step.map(|s| s.instruction).unwrap_or_default();
        let iteration = self.loop_of(&label).iteration;
        let instruction = format!(
            "You judge iteration {iteration} of the step `{label}`. It was asked:\n{request}\n\n\
             Its output:\n{output}\n\nAnswer through your output schema: verdict `pass` if the \
             output does what was asked, else `revise`, with each issue to fix in `issues`, \
             specific enough to act on.",
            output = envelope.output,
        );
        let judge_label = StepSpec::judge_label(&label);
        let attempt = self.attempts.get(&judge_label).copied().unwrap_or(0) + 1;
        self.attempts.insert(judge_label.clone(), attempt);
        let planned = PlannedStep {
            id: JobId::new(),
            workdir: self.step_workdir(&judge_label, attempt),
            label: judge_label,
            agent,
            instruction,
            attempt,
            output_schema: Some(JudgeVerdict::schema()),
            left,
            role: Role::Judge(label),
        };
        self.admit(myself, vec![planned]).await;
        Ok(())
    }

    /// A judge's job ended: its answer is the iteration's verdict.
    pub(super) async fn judged(
        &mut self,
        myself: &ActorRef<RunMsg>,
        of: String,
        envelope: ResultEnvelope,
    ) -> Result<(), ActorProcessingErr> {
        self.loop_spent(&of, &envelope);
        let Some(&worker) = self.checking.get(&of) else {
            return Ok(());
        };
        let found = verdict_of(&envelope);
        self.iteration_checked(myself, of, worker, found).await
    }

    /// A check has found: journaled and durable first (I-56), then the
    /// step passes, runs again told what was found, or, past a bound or
    /// when the check could not be made, fails for good (`check_failed`).
    pub(super) async fn iteration_checked(
        &mut self,
        myself: &ActorRef<RunMsg>,
        label: String,
        job: JobId,
        found: Found,
    ) -> Result<(), ActorProcessingErr> {
        if self.checking.get(&label) != Some(&job) || self.finish.is_some() {
            return Ok(());
        }
        let Some(until) = self.until(&label) else {
            return Ok(());
        };
        let iteration = self.loop_of(&label).iteration;
        let ended = if found.passed {
            None
        } else if let Some(why) = found.failed.clone() {
            Some(why)
        } else if iteration >= until.max_iterations() {
            Some(format!(
                "until.max_iterations ({}) reached",
                until.max_iterations()
            ))
        } else {
            self.loop_left(&label).err()
        };
        // The iteration's end is told first: a watcher sees it, then its check.
        self.ended.settle(&self.ctx, self.id).await?;
        tracing::info!(run = %self.id, step = %label, iteration, passed = found.passed, ended = ended.as_deref().unwrap_or(""), "a loop's iteration was checked");
        self.ctx.events.emit(
            self.id,
            EventKind::IterationChecked {
                id: job,
                label: label.clone(),
                iteration,
                passed: found.passed,
                verdict: found.verdict,
                issues: found.issues.clone(),
                ended: ended.clone(),
            },
        );
        self.ctx.journal.flush().await?;
        self.checking.remove(&label);
        if found.passed {
            return self.next_group_if_done(myself).await;
        }
        let worker = self.steps.get(&job).and_then(|s| {
            let e = s.envelope.as_ref()?;
            Some((s.attempt, e.output.clone()))
        });
        let (attempt, output) = worker.unwrap_or((iteration, serde_json::Value::Null));
        if let Some(ended) = ended {
            let why = Until::failure(iteration, &ended, found.verdict, &found.issues);
            return self.loop_failed(myself, label, attempt, output, why).await;
        }
        let state = self.loop_of(&label);
        state.iteration += 1;
        state.previous = Some((output, found.issues));
        self.next_attempt(myself, label, attempt).await;
        Ok(())
    }

    /// The loop ends without passing: the step has failed for good (class
    /// `check_failed`), as a step whose attempt failed does: an optional one
    /// leaves its run partial, a rescuer takes over, or the run fails.
    pub(super) async fn loop_failed(
        &mut self,
        myself: &ActorRef<RunMsg>,
        label: String,
        attempt: u32,
        output: serde_json::Value,
        why: String,
    ) -> Result<(), ActorProcessingErr> {
        self.checking.remove(&label);
        let step = self.step_spec(&label).cloned();
        if step.as_ref().is_some_and(|s| s.on_fail.is_some()) {
            let workdir = self.step_workdir(&label, 1).display().to_string();
            let failed = Failed {
                label,
                attempt,
                class: ErrorClass::CheckFailed,
                error: why,
                output,
                workdir,
            };
            self.rescue_or_fail(myself, failed).await;
            return Ok(());
        }
        if step.is_some_and(|s| s.optional) {
            self.limitations
                .push(StepSpec::optional_limitation(&label, Status::Failed, &why));
            return self.next_group_if_done(myself).await;
        }
        self.begin_finish(
            Status::Failed,
            Some(ErrorClass::CheckFailed),
            format!("step {label} failed: {why}"),
        );
        Ok(())
    }
}
