//! Agents that workloads are made of, written as scripts: a leaf that
//! answers at once, and parents that delegate to it (`leaf`) in the shapes
//! the benchmarks measure. Each returns an agent.md text for
//! `TestNode::start`; a parent needs the leaf started beside it as `leaf`.

use arbor_testkit::agent_md;

/// A leaf that submits on its first turn.
pub fn leaf_at_once() -> String {
    agent_md(
        "description: answers at once\nscript:\n  - call: {tool: submit_output, args: {output: ok}}",
    )
}

/// A parent that delegates `calls` times to `leaf` (wait = true), one call
/// a turn, then submits.
pub fn serial_parent(calls: usize) -> String {
    // The same call again and again is the workload, not a stuck loop.
    let mut front = format!(
        "subagents: [leaf]\nmax_turns: {}\nmax_repeats: {}\nscript:\n",
        calls + 1,
        calls + 1
    );
    for _ in 0..calls {
        front.push_str("  - call: {tool: delegate, args: {jobs: [{agent: leaf, request: go}]}}\n");
    }
    front.push_str("  - call: {tool: submit_output, args: {output: done}}");
    agent_md(&front)
}

/// A parent that delegates `batches` batches of `batch` leaves (wait =
/// false) and collects each before the next, then submits.
pub fn fan_out_parent(batch: usize, batches: usize) -> String {
    let jobs = vec!["{agent: leaf, request: go}"; batch].join(", ");
    let mut front = format!(
        "subagents: [leaf]\nmax_turns: {}\nscript:\n",
        2 * batches + 1
    );
    for _ in 0..batches {
        front.push_str(&format!(
            "  - call: {{tool: delegate, args: {{wait: false, jobs: [{jobs}]}}}}\n"
        ));
        front.push_str("  - call: {tool: collect, args: {}}\n");
    }
    front.push_str("  - call: {tool: submit_output, args: {output: done}}");
    agent_md(&front)
}
