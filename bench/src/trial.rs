//! The fixed protocol every goal is measured by: one unmeasured warm-up of
//! each side, then `REPETITIONS` repetitions that alternate baseline and
//! arbor (baseline, arbor, baseline, arbor, ...), so that both sides share
//! whatever the machine is doing at the time (`balanced` lets a goal whose
//! figures scatter more ask for more repetitions). Each call of a side returns
//! that repetition's one figure; the goal's figures are the medians of them.

use crate::report::Row;

/// Measured repetitions of each side.
pub const REPETITIONS: usize = 5;

/// Which repetition a side is asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rep {
    /// Not measured: its figure is thrown away.
    Warmup,
    /// The `n`th measured repetition, from 0.
    Measured(usize),
}

impl Rep {
    /// `warm-up` or `rep 2/5`, for progress lines.
    pub fn name(self, of: usize) -> String {
        match self {
            Rep::Warmup => "warm-up".into(),
            Rep::Measured(n) => format!("rep {}/{of}", n + 1),
        }
    }
}

/// Runs the protocol on two sides; returns their measured figures as a row
/// labelled `label` (empty when the goal has one row).
pub async fn interleaved(
    goal: &str,
    label: &str,
    baseline: impl AsyncFnMut(Rep) -> anyhow::Result<f64>,
    arbor: impl AsyncFnMut(Rep) -> anyhow::Result<f64>,
) -> anyhow::Result<Row> {
    protocol(goal, label, REPETITIONS, false, baseline, arbor).await
}

/// As `interleaved`, but each repetition runs baseline, arbor, arbor,
/// baseline and takes each side's mean of its two: for two sides that each
/// leave work behind them (a journal's writeback on the disk they share),
/// which would otherwise fall on the second side every time. `repetitions`
/// measured repetitions, after the warm-up.
pub async fn balanced(
    goal: &str,
    label: &str,
    repetitions: usize,
    baseline: impl AsyncFnMut(Rep) -> anyhow::Result<f64>,
    arbor: impl AsyncFnMut(Rep) -> anyhow::Result<f64>,
) -> anyhow::Result<Row> {
    protocol(goal, label, repetitions, true, baseline, arbor).await
}

async fn protocol(
    goal: &str,
    label: &str,
    repetitions: usize,
    swap: bool,
    mut baseline: impl AsyncFnMut(Rep) -> anyhow::Result<f64>,
    mut arbor: impl AsyncFnMut(Rep) -> anyhow::Result<f64>,
) -> anyhow::Result<Row> {
    let mut row = Row {
        label: label.to_string(),
        baseline: Vec::with_capacity(repetitions),
        arbor: Vec::with_capacity(repetitions),
    };
    let name = format!("{goal} {label}");
    let name = name.trim_end();
    let reps = std::iter::once(Rep::Warmup).chain((0..repetitions).map(Rep::Measured));
    for rep in reps {
        progress(name, &format!("{} baseline", rep.name(repetitions)));
        let mut b = baseline(rep).await?;
        progress(name, &format!("{} arbor", rep.name(repetitions)));
        let mut a = arbor(rep).await?;
        if swap {
            progress(name, &format!("{} arbor again", rep.name(repetitions)));
            a = (a + arbor(rep).await?) / 2.0;
            progress(name, &format!("{} baseline again", rep.name(repetitions)));
            b = (b + baseline(rep).await?) / 2.0;
        }
        if rep != Rep::Warmup {
            row.baseline.push(b);
            row.arbor.push(a);
        }
    }
    Ok(row)
}

/// One progress line on stderr: `[P3 flat] rep 2/5 arbor`.
pub fn progress(name: &str, what: &str) {
    eprintln!("[{name}] {what}");
}
