//! The scripted model: the embedded default. An agent's `script:` is its
//! answers, one turn per model call, so examples and tests run offline and
//! the same every time.
//!
//! Like a real provider it honours the call's max output tokens: usage above
//! it is cut to it and the turn is marked truncated. Its input count is exact
//! (the script's, or the loop's estimate), so the reservation made with
//! `count_input` always covers what the call is charged (I-11).

use arbor_actors::model::{
    Model, ModelError, ModelFactory, ModelInfo, ModelReply, ModelRequest, ToolCall, estimate_tokens,
};
use arbor_protocol::{AgentDef, ErrorClass, ModelRef, ScriptTurn, Usage};
use futures::future::BoxFuture;
use std::sync::Arc;

pub struct ScriptedModel {
    turns: Arc<Vec<ScriptTurn>>,
    info: ModelInfo,
    /// A scripted provider's `fail_with`: every call fails so.
    fail_with: Option<ErrorClass>,
}

impl ScriptedModel {
    /// `turns`, shared with the agent's definition: a job's model costs no copy of its script.
    pub fn new(turns: impl Into<Arc<Vec<ScriptTurn>>>) -> Self {
        Self {
            turns: turns.into(),
            info: ModelInfo::scripted(),
            fail_with: None,
        }
    }

    /// The script answered under a scripted provider's model (`info`: its
    /// name, supply, window and prices), or every call failed with `fail_with`.
    pub fn as_provider(
        turns: impl Into<Arc<Vec<ScriptTurn>>>,
        info: ModelInfo,
        fail_with: Option<ErrorClass>,
    ) -> Self {
        Self {
            info,
            fail_with,
            ..Self::new(turns)
        }
    }

    fn turn(&self, request: &ModelRequest) -> Option<&ScriptTurn> {
        self.turns.get(request.turn as usize)
    }
}

impl Model for ScriptedModel {
    fn count_input(&self, request: &ModelRequest) -> u64 {
        self.turn(request)
            .and_then(|t| t.usage)
            .map(|u| u.input)
            .unwrap_or_else(|| estimate_tokens(request))
    }

    fn info(&self) -> ModelInfo {
        self.info.clone()
    }

    fn complete(
        &self,
        request: ModelRequest,
    ) -> BoxFuture<'static, Result<ModelReply, ModelError>> {
        if let Some(class) = self.fail_with {
            let why = format!(
                "{}/{} fails every call with {class} (its provider's fail_with)",
                self.info.provider, self.info.model
            );
            return Box::pin(std::future::ready(Err(ModelError::new(class, why))));
        }
        let input = self.count_input(&request);
        let turn = self.turn(&request).cloned();
        Box::pin(async move {
            // A script that runs out ends the loop with no answer.
            let Some(turn) = turn else {
                return Ok(ModelReply {
                    thinking: vec![],
                    text: None,
                    calls: vec![],
                    usage: Some(Usage {
                        input_tokens: input,
                        output_tokens: 0,
                    }),
                    truncated: false,
                });
            };
            if let Some(delay) = turn.delay {
                tokio::time::sleep(delay).await;
            }
            let calls: Vec<ToolCall> = turn
                .calls
                .iter()
                .enumerate()
                .map(|(i, c)| ToolCall {
                    id: format!("call-{}-{i}", request.turn),
                    tool: c.tool.clone(),
                    args: c.args.clone(),
                })
                .collect();
            let wanted = turn.usage.map(|u| u.output).unwrap_or_else(|| {
                let bytes = turn.say.as_ref().map_or(0, |s| s.len())
                    + calls
                        .iter()
                        .map(|c| c.tool.len() + c.args.to_string().len())
                        .sum::<usize>();
                (bytes as u64).div_ceil(4).max(1)
            });
            let output = wanted.min(request.max_output_tokens);
            Ok(ModelReply {
                thinking: vec![],
                text: turn.say.clone(),
                calls,
                usage: Some(Usage {
                    input_tokens: input,
                    output_tokens: output,
                }),
                truncated: output < wanted,
            })
        })
    }
}

/// Gives each agent its model: scripted agents their script. Providers come
/// with their own adapter; until then an agent that names one is refused at load.
#[derive(Default)]
pub struct DefaultModels;

impl ModelFactory for DefaultModels {
    fn model_for(&self, agent: &AgentDef) -> Result<Arc<dyn Model>, String> {
        match &agent.model {
            ModelRef::Scripted => Ok(Arc::new(ScriptedModel::new(Arc::clone(&agent.script)))),
            ModelRef::Provider { provider, model } => Err(format!(
                "agent {}: model {provider}/{model}: no provider adapter is configured",
                agent.name
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arbor_protocol::{ScriptCall, ScriptUsage};

    fn request(turn: u32, max_output: u64) -> ModelRequest {
        ModelRequest {
            input_estimate: 0,
            agent: "a".into(),
            system: "sys".into(),
            messages: vec![],
            tools: Arc::new([]),
            max_output_tokens: max_output,
            wind_down: None,
            settings: Default::default(),
            turn,
            meter: Default::default(),
        }
    }

    #[tokio::test]
    async fn output_above_the_calls_max_is_cut_and_marked_truncated() {
        let model = ScriptedModel::new(vec![ScriptTurn {
            say: Some("hi".into()),
            calls: vec![ScriptCall {
                tool: "submit_output".into(),
                args: serde_json::json!({"output": "x"}),
            }],
            usage: Some(ScriptUsage {
                input: 10,
                output: 500,
            }),
            delay: None,
        }]);
        let reply = model.complete(request(0, 100)).await.unwrap();
        let usage = reply.usage.unwrap();
        assert_eq!(usage.input_tokens, 10);
        assert_eq!(usage.output_tokens, 100);
        assert!(reply.truncated);
        assert_eq!(model.count_input(&request(0, 100)), 10);
        let reply = model.complete(request(0, 1000)).await.unwrap();
        assert!(!reply.truncated);
        assert_eq!(reply.usage.unwrap().output_tokens, 500);
    }

    #[tokio::test]
    async fn a_script_that_runs_out_answers_nothing() {
        let model = ScriptedModel::new(vec![]);
        let reply = model.complete(request(0, 100)).await.unwrap();
        assert!(reply.text.is_none() && reply.calls.is_empty());
    }
}
