//! What a step's model is sent first, as its provider would receive it
//! (`arbor prompt`): the agent's prompt and roster, its built-in tools with
//! their schemas, and the request body of its provider's wire format.
//!
//! Nothing here shows a secret or an API key: the body is what goes over
//! the wire, and a key travels in a header. The MCP servers the agent names
//! are started and asked for their tools as a job's would be (sealed, with
//! their declared secrets), so their tools appear as the model sees them.

use crate::workspace::Workspace;
use arbor_actors::agent_loop::{Prompt, first_request, max_output_limit};
use arbor_actors::mcp::McpToolbox;
use arbor_actors::model::ModelInfo;
use arbor_actors::model::ToolSpec;
use arbor_actors::policy::Policy;
use arbor_protocol::{ModelRef, NodeKind, Settings};
use arbor_providers::{ProviderKind, request_body};
use std::collections::BTreeMap;
use std::sync::Arc;

/// The first request body a step of `agent` would send when asked
/// `input`, in `wire` (default: its provider's; the scripted model's is
/// shown as OpenAI's).
pub async fn first_body(
    workspace: &Workspace,
    agent: &str,
    input: &str,
    wire: Option<ProviderKind>,
) -> Result<serde_json::Value, String> {
    let def = workspace.agents.get(agent).ok_or_else(|| {
        format!(
            "no agent {agent:?} in this workspace (it has: {})",
            workspace
                .agents
                .keys()
                .cloned()
                .collect::<Vec<_>>()
                .join(", ")
        )
    })?;
    let config = &workspace.config;
    let (own_wire, model_id, defaults, stream, info) = match &def.model {
        ModelRef::Scripted => (
            ProviderKind::Openai,
            "scripted".to_string(),
            Settings::default(),
            false,
            ModelInfo::scripted(),
        ),
        ModelRef::Provider { provider, model } => {
            let entry = config.providers.get(provider).ok_or_else(|| {
                format!("agent {agent:?}: no provider {provider:?} in arbor.toml")
            })?;
            let model = entry.models.get(model).ok_or_else(|| {
                format!("agent {agent:?}: provider {provider:?} has no model {model:?}")
            })?;
            let info = entry.model_info(model);
            (
                entry.kind,
                model.id.clone(),
                model.settings,
                entry.stream,
                info,
            )
        }
    };
    // The loop's own rule: its output cap, a thinking budget included.
    let max_output = max_output_limit(&info, &config.limits, def.settings);
    let policy = Policy::root(def, &config.limits, &config.approvals.tools);
    let offered = policy.offered(def, NodeKind::Step, 0, &config.limits);
    let agents: BTreeMap<String, Arc<_>> = workspace
        .agents
        .iter()
        .map(|(name, def)| (name.clone(), Arc::new(def.clone())))
        .collect();
    let mcp = mcp_tools(workspace, &policy).await?;
    let skills = arbor_actors::skills::listed(&workspace.skills, def, &policy);
    let prompt = Prompt::for_job(def, &offered, &agents, &skills, &mcp, None);
    let request = first_request(def, &prompt, input, max_output);
    let kind = wire.unwrap_or(own_wire);
    Ok(request_body(
        kind,
        &model_id,
        defaults,
        info.thinking_tokens,
        &request,
        max_output,
        stream,
    ))
}

/// The MCP tools a job under `policy` is offered, its servers listed as a
/// node lists them.
async fn mcp_tools(workspace: &Workspace, policy: &Policy) -> Result<Vec<ToolSpec>, String> {
    if !policy.may_use_mcp() {
        return Ok(vec![]);
    }
    let (catalog, _scratch) = crate::check::listing_catalog(workspace)
        .await
        .map_err(|(_, message)| message)?;
    let toolbox = McpToolbox::for_job(&catalog, policy).await?;
    Ok(toolbox.specs().to_vec())
}
