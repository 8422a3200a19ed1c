//! Nothing here: the tests are the example (`tests/research.rs`).
