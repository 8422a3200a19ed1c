//! `flows/NAME.toml`: groups of steps, a budget and a timeout.

use super::parse::{LoadError, budget_tokens, check_name, invalid, toml_error};
use arbor_protocol::tools::parse_duration_arg;
use arbor_protocol::{AgentDef, FlowSpec};
use std::collections::BTreeMap;
use std::path::Path;

/// The flow's budget pause (`on_ceiling`, `pause_timeout`): how long its
/// runs may wait for a top-up, or none if they end at their ceiling.
pub(super) fn pause(flow: &FlowSpec) -> Result<Option<std::time::Duration>, String> {
    let timeout = parse_duration_arg("pause_timeout", flow.pause_timeout.as_deref())?;
    arbor_protocol::OnCeiling::pause(flow.on_ceiling, timeout)
}

pub(super) fn parse_flow(
    name: &str,
    text: &str,
    path: &Path,
    agents: &BTreeMap<String, AgentDef>,
) -> Result<FlowSpec, LoadError> {
    check_name("flow", name).map_err(|m| invalid(path, m))?;
    let flow: FlowSpec = toml::from_str(text).map_err(|e| invalid(path, toml_error(text, &e)))?;
    budget_tokens(flow.budget.as_ref()).map_err(|m| invalid(path, m))?;
    if let Some(budget) = &flow.budget {
        budget.usd_micros().map_err(|m| invalid(path, m))?;
    }
    parse_duration_arg("timeout", flow.timeout.as_deref()).map_err(|m| invalid(path, m))?;
    pause(&flow).map_err(|m| invalid(path, m))?;
    super::input::check_declaration(&flow).map_err(|m| invalid(path, m))?;
    if flow.groups.is_empty() {
        return Err(invalid(
            path,
            "no `[[group]]`: a flow needs at least one group of steps",
        ));
    }
    if let Some(reviewer) = &flow.verify {
        if !agents.contains_key(reviewer) {
            return Err(invalid(
                path,
                format!("verify names unknown agent `{reviewer}`"),
            ));
        }
        let spec = arbor_protocol::RunSpec {
            groups: flow.groups.clone(),
            ..arbor_protocol::RunSpec::single("x", "x", 1)
        };
        if spec
            .step_labels()
            .iter()
            .flatten()
            .any(|l| l == arbor_protocol::RunSpec::REVIEW_LABEL)
        {
            return Err(invalid(
                path,
                format!(
                    "a step is labelled `{0}`, the label of the run's reviewer (`verify`): give it another label",
                    arbor_protocol::RunSpec::REVIEW_LABEL
                ),
            ));
        }
    }
    for (g, group) in flow.groups.iter().enumerate() {
        if group.steps.is_empty() {
            return Err(invalid(path, format!("group {} has no steps", g + 1)));
        }
        for (s, step) in group.steps.iter().enumerate() {
            if !agents.contains_key(&step.agent) {
                return Err(invalid(
                    path,
                    format!(
                        "step {} of group {} names unknown agent `{}`",
                        s + 1,
                        g + 1,
                        step.agent
                    ),
                ));
            }
            if let Some(rescuer) = &step.on_fail
                && !agents.contains_key(rescuer)
            {
                return Err(invalid(
                    path,
                    format!(
                        "step {} of group {} names unknown agent `{rescuer}` in on_fail",
                        s + 1,
                        g + 1
                    ),
                ));
            }
            if let Some(until) = &step.until {
                check_until(until, agents).map_err(|m| {
                    invalid(path, format!("step {} of group {}: {m}", s + 1, g + 1))
                })?;
            }
            if let Some(retry) = &step.retry {
                retry.check().map_err(|m| {
                    invalid(path, format!("step {} of group {}: {m}", s + 1, g + 1))
                })?;
            }
        }
    }
    Ok(flow)
}

/// A step's loop: one check, bounds that are bounds, a pattern that
/// compiles, a judge that is an agent.
fn check_until(
    until: &arbor_protocol::Until,
    agents: &BTreeMap<String, AgentDef>,
) -> Result<(), String> {
    until.check()?;
    if let Some(pattern) = &until.pattern {
        regex::Regex::new(pattern)
            .map_err(|e| format!("until.pattern {pattern:?} is not a regular expression: {e}"))?;
    }
    if let Some(judge) = &until.judge
        && !agents.contains_key(judge)
    {
        return Err(format!("until.judge names unknown agent `{judge}`"));
    }
    Ok(())
}
