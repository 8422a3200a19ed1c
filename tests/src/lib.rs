//! arbor's own benchmarks' and scenario suites' helpers: the agents the
//! benchmarks run, bare ractor baselines, measurement, and journals built
//! record by record. Users test their agents with `arbor-testkit`.

pub mod agents;
pub mod bare;
pub mod load;
pub mod measure;
pub mod scenarios;
pub mod synthetic;
pub mod webhooks;
