//! What a goal reports, and how it is printed: the table for people, the
//! samples, the notes, and the one machine line per goal.
//!
//! Every figure is a plain number in its unit's base (seconds, items per
//! second, bytes); a ratio is always arbor's median over the baseline's
//! median, of the same run.

use arbor_tests::measure::median;

/// The unit of a figure: how it is printed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    /// Seconds, printed as ns, us, ms or s.
    Seconds,
    /// Items per second, printed as /s, k/s or M/s.
    PerSecond,
    /// Bytes, printed as B, KiB, MiB or GiB.
    Bytes,
}

/// What the ratio arbor / baseline must be for the goal to hold.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Bound {
    AtMost(f64),
    AtLeast(f64),
}

impl Bound {
    pub fn holds(self, x: f64) -> bool {
        match self {
            Bound::AtMost(limit) => x <= limit,
            Bound::AtLeast(limit) => x >= limit,
        }
    }

    /// `<=4`, `>=0.5`: as the machine line writes it.
    pub fn text(self) -> String {
        match self {
            Bound::AtMost(limit) => format!("<={}", plain(limit)),
            Bound::AtLeast(limit) => format!(">={}", plain(limit)),
        }
    }

    /// The ratio that misses it by the most, of two.
    fn worse(self, a: f64, b: f64) -> f64 {
        match self {
            Bound::AtMost(_) => a.max(b),
            Bound::AtLeast(_) => a.min(b),
        }
    }
}

/// One measured comparison: the samples of both sides, in run order.
#[derive(Clone, Debug)]
pub struct Row {
    /// What is measured, for the table ("flat: 1 x 10,000").
    pub label: String,
    pub baseline: Vec<f64>,
    pub arbor: Vec<f64>,
}

impl Row {
    pub fn baseline_median(&self) -> f64 {
        median(&self.baseline)
    }

    pub fn arbor_median(&self) -> f64 {
        median(&self.arbor)
    }

    /// arbor's median over the baseline's.
    pub fn ratio(&self) -> f64 {
        self.arbor_median() / self.baseline_median()
    }
}

/// Everything one goal reports.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub id: &'static str,
    /// One line: what the figure is ("delegate round trip, per call").
    pub what: &'static str,
    pub unit: Unit,
    /// What each figure is per ("per call", "jobs/s").
    pub per: &'static str,
    pub bound: Bound,
    /// Usually one; P3 has one per tree shape.
    pub rows: Vec<Row>,
    /// Extra conditions the goal needs besides its ratio (P3: no late
    /// output). A failed one makes the goal miss.
    pub conditions: Vec<(String, bool)>,
    /// Figures and facts for people: absolute goals, sizes, stand-ins.
    pub notes: Vec<String>,
}

impl Outcome {
    /// The row the machine line reports: the one with the worst ratio.
    pub fn line_row(&self) -> &Row {
        self.rows
            .iter()
            .reduce(|a, b| {
                let worse = self.bound.worse(a.ratio(), b.ratio());
                if worse == a.ratio() { a } else { b }
            })
            .expect("an outcome has a row")
    }

    pub fn holds(&self) -> bool {
        self.rows.iter().all(|r| self.bound.holds(r.ratio()))
            && self.conditions.iter().all(|(_, ok)| *ok)
    }

    /// `P1 baseline=152us arbor=2.10ms ratio=13.8 goal=<=4 misses`
    pub fn line(&self) -> String {
        let row = self.line_row();
        format!(
            "{} baseline={} arbor={} ratio={} goal={} {}",
            self.id,
            figure(row.baseline_median(), self.unit),
            figure(row.arbor_median(), self.unit),
            significant(row.ratio()),
            self.bound.text(),
            verdict(self.holds()),
        )
    }
}

pub fn verdict(holds: bool) -> &'static str {
    if holds { "holds" } else { "misses" }
}

/// The table for people, then each goal's samples and notes.
pub fn print_table(outcomes: &[Outcome]) {
    let header = [
        "goal", "what", "baseline", "arbor", "unit", "ratio", "target", "verdict",
    ];
    let mut lines: Vec<[String; 8]> = vec![header.map(String::from)];
    for outcome in outcomes {
        for row in &outcome.rows {
            let name = if outcome.rows.len() > 1 {
                format!("{} {}", outcome.what, row.label)
            } else {
                outcome.what.to_string()
            };
            lines.push([
                outcome.id.to_string(),
                name,
                figure(row.baseline_median(), outcome.unit),
                figure(row.arbor_median(), outcome.unit),
                outcome.per.to_string(),
                significant(row.ratio()),
                outcome.bound.text(),
                verdict(outcome.bound.holds(row.ratio())).to_string(),
            ]);
        }
    }
    let widths: Vec<usize> = (0..8)
        .map(|c| {
            lines
                .iter()
                .map(|l| l[c].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for line in &lines {
        let cells: Vec<String> = line
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(c, (cell, width))| {
                // Text left, figures right.
                if c < 2 || c == 4 || c == 7 {
                    format!("{cell:<width$}")
                } else {
                    format!("{cell:>width$}")
                }
            })
            .collect();
        println!("{}", cells.join("  ").trim_end());
    }
    println!(
        "(medians of the repetitions listed below, 5 unless a goal says; ratio = arbor / baseline, of the same run)"
    );
    for outcome in outcomes {
        println!();
        for row in &outcome.rows {
            let label = if outcome.rows.len() > 1 {
                format!(" {}", row.label)
            } else {
                String::new()
            };
            let samples = |xs: &[f64]| {
                xs.iter()
                    .map(|x| figure(*x, outcome.unit))
                    .collect::<Vec<_>>()
                    .join(" ")
            };
            println!(
                "{}{label} baseline samples: {}",
                outcome.id,
                samples(&row.baseline)
            );
            println!(
                "{}{label} arbor samples:    {}",
                outcome.id,
                samples(&row.arbor)
            );
        }
        for (condition, ok) in &outcome.conditions {
            println!("{} {condition}: {}", outcome.id, verdict(*ok));
        }
        for note in &outcome.notes {
            println!("{} {note}", outcome.id);
        }
    }
}

/// A figure with its unit, three significant digits, no space:
/// `152us`, `2.10ms`, `880/s`, `12.3k/s`, `2.31KiB`.
pub fn figure(x: f64, unit: Unit) -> String {
    let (scaled, suffix) = match unit {
        Unit::Seconds => match x {
            x if x < 1e-6 => (x * 1e9, "ns"),
            x if x < 1e-3 => (x * 1e6, "us"),
            x if x < 1.0 => (x * 1e3, "ms"),
            x => (x, "s"),
        },
        Unit::PerSecond => match x {
            x if x < 1e3 => (x, "/s"),
            x if x < 1e6 => (x / 1e3, "k/s"),
            x => (x / 1e6, "M/s"),
        },
        Unit::Bytes => {
            const KIB: f64 = 1024.0;
            match x {
                x if x < KIB => (x, "B"),
                x if x < KIB * KIB => (x / KIB, "KiB"),
                x if x < KIB * KIB * KIB => (x / (KIB * KIB), "MiB"),
                x => (x / (KIB * KIB * KIB), "GiB"),
            }
        }
    };
    format!("{}{suffix}", significant(scaled))
}

/// Three significant digits (whole numbers from 100 up): 13.8, 0.312, 152, 4210.
pub fn significant(x: f64) -> String {
    if !x.is_finite() {
        return format!("{x}");
    }
    let magnitude = x.abs();
    let decimals = match magnitude {
        m if m >= 100.0 || m == 0.0 => 0,
        m if m >= 10.0 => 1,
        m if m >= 1.0 => 2,
        m => (2 - m.log10().floor() as i32).clamp(0, 9) as usize,
    };
    format!("{x:.decimals$}")
}

/// A goal's limit as written in the brief: 4, 0.5, 1.5.
fn plain(x: f64) -> String {
    let text = format!("{x}");
    text.strip_suffix(".0").map(str::to_string).unwrap_or(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(x: f64, unit: Unit, expected: &str) {
        assert_eq!(figure(x, unit), expected, "{x} {unit:?}");
    }

    #[test]
    fn figures_carry_their_unit_in_three_significant_digits() {
        check(152e-6, Unit::Seconds, "152us");
        check(2.1e-3, Unit::Seconds, "2.10ms");
        check(13.8, Unit::Seconds, "13.8s");
        check(880.0, Unit::PerSecond, "880/s");
        check(12_345.0, Unit::PerSecond, "12.3k/s");
        check(2_370.0, Unit::Bytes, "2.31KiB");
        check(0.0312e-9, Unit::Seconds, "0.0312ns");
    }

    #[test]
    fn a_line_reports_the_worst_row_and_holds_only_if_every_row_and_condition_does() {
        let row = |label: &str, baseline: f64, arbor: f64| Row {
            label: label.into(),
            baseline: vec![baseline; 5],
            arbor: vec![arbor; 5],
        };
        let mut outcome = Outcome {
            id: "P3",
            what: "stop",
            unit: Unit::Seconds,
            per: "stop",
            bound: Bound::AtMost(2.0),
            rows: vec![row("flat", 0.01, 0.015), row("deep", 0.01, 0.03)],
            conditions: vec![],
            notes: vec![],
        };
        assert_eq!(
            outcome.line(),
            "P3 baseline=10.0ms arbor=30.0ms ratio=3.00 goal=<=2 misses"
        );
        outcome.rows.pop();
        assert!(outcome.holds());
        outcome
            .conditions
            .push(("late outputs 1 (must be 0)".into(), false));
        assert!(!outcome.holds());
        assert_eq!(Bound::AtLeast(0.5).text(), ">=0.5");
    }
}
