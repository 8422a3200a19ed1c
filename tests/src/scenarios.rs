//! Workloads that `explore_crashes` runs in arbor's own suites.

use arbor_testkit::faults::{FaultyModels, ModelFault};
use arbor_testkit::{Scenario, agent_md};
use std::sync::Arc;

/// A step (retried up to 100 times) fans out to four workers in one call;
/// each meets a 429 on its first model call (retried), runs a real command
/// that leaves a background process behind, then another, then answers.
/// While it runs, the first worker is steered.
pub fn fan_out_with_retries_and_steer() -> Scenario {
    let lead = agent_md(
        "tools: [exec]\nsubagents: [worker]\nmax_turns: 10\nscript:\n  - call: {tool: delegate, args: {jobs: [{agent: worker, request: a, label: w1}, {agent: worker, request: b, label: w2}, {agent: worker, request: c, label: w3}, {agent: worker, request: d, label: w4}]}}\n  - call: {tool: submit_output, args: {output: fanned}}",
    );
    let worker = agent_md(
        "description: works with real processes\ntools: [exec, write_file]\nscript:\n  - usage: {input: 20, output: 5}\n    call: {tool: exec, args: {command: \"sleep 5 >/dev/null 2>&1 & sleep 0.02; echo started\"}}\n  - usage: {input: 20, output: 5}\n    delay: 20ms\n    call: {tool: write_file, args: {path: out.txt, content: done}}\n  - call: {tool: submit_output, args: {output: worked}}",
    );
    Scenario::flow_texts(
        None,
        &[("lead", &lead), ("worker", &worker)],
        &[(
            "fan",
            "budget = { tokens = 1000000 }\n[[group]]\nsteps = [{ agent = \"lead\", instruction = \"go\", retries = 100 }]\n",
        )],
        "fan",
    )
    .models(|workspace| {
        let models = FaultyModels::wrapping(Arc::new(arbor_runtime::Models::new(
            &workspace.config.providers,
        )));
        models.on_every_job("worker", [ModelFault::RateLimited]);
        models
    })
    .during(|node, run| {
        Box::pin(async move {
            let worker = node.wait_for(run, "w1").await;
            // Refused once the worker has ended: the steer is part of the
            // workload, not something it must win.
            let _ = node.steer(worker, "be quick").await;
        })
    })
}
