//! Self-check: run a suite clean (it must pass), then once per planted fault (it must fail).
//! A harness that passes a broken engine is worse than none.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::faults::{self, Fault, Faults};
use crate::report::{Report, Row};
use crate::run::{Progress, RunOptions, run_suite};
use crate::vocab::{self, Scenario, Suite, Verdict};

/// What one fault did to one scenario.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Cell {
    pub worst: Verdict,
    pub failed_rows: usize,
    pub rows: usize,
    /// The first failing row: `checkpoint/prompt/case/backend`.
    pub first_row: Option<String>,
    /// Its first divergence in layout terms, or its failure text.
    pub location: Option<String>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct FaultOutcome {
    pub fault: String,
    pub caught: bool,
    pub scenarios: BTreeMap<String, Cell>,
    /// Why the fault was not planted: none of the scenarios that exercise its code path ran
    /// (a selftest narrowed with `--scenario` or `--filter`). Neither caught nor missed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped: Option<String>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct SelftestReport {
    pub suite: String,
    pub clean_passed: bool,
    pub clean_failures: Vec<String>,
    pub faults: Vec<FaultOutcome>,
    pub seconds: f64,
}

impl SelftestReport {
    pub fn ok(&self) -> bool {
        self.clean_passed && self.faults.iter().all(|f| f.caught || f.skipped.is_some())
    }

    /// Faults that were planted (not skipped for the selection).
    pub fn planted(&self) -> impl Iterator<Item = &FaultOutcome> {
        self.faults.iter().filter(|f| f.skipped.is_none())
    }
}

/// The scenarios whose cases run the code path `fault` breaks (docs/selftest.md).
/// A selftest narrowed to other scenarios cannot catch it, so it is skipped and named rather
/// than reported as missed: a harness that cries "missed" for a fault it could never see
/// teaches people to ignore misses. `tests/selftest.rs` checks this list against what the full
/// fixture suite actually catches.
pub fn catching_scenarios(fault: Fault) -> &'static [Scenario] {
    use Scenario::*;
    match fault {
        Fault::RopeBatchAlias => &[Batch2, Concurrent, Prefix],
        Fault::PagedTrimNoop | Fault::RewindKeepsPosition => &[Padded, Rollback],
        Fault::GatherOffByOne | Fault::StaleBlock => vocab::STEP_LEVEL,
        Fault::PadUnmasked => &[Padded],
        Fault::BatchRowSwap => &[Batch2, Concurrent, Padded],
        Fault::CowSkipped => &[Prefix],
        Fault::BlockLeak => &[Concurrent, Prefix],
        Fault::RaggedMaskWide => &[Batch2, Concurrent, Padded],
        Fault::WindowReleaseEarly => vocab::STEP_LEVEL,
    }
}

/// Why `fault` cannot show in what ran clean, beyond the scenarios: its code path never ran.
/// A window fault needs a paged sliding-window layer that released a block, which only a
/// windowed checkpoint with a sequence longer than its window gives.
fn unexercised(fault: Fault, clean: &Report) -> Option<String> {
    match fault {
        Fault::WindowReleaseEarly => {
            let released: u64 =
                clean.rows.iter().filter_map(|r| r.counters.and_then(|c| c.window_blocks_released)).sum();
            (released == 0).then(|| "no paged sliding-window layer released a block in the clean run".to_string())
        }
        _ => None,
    }
}

/// One line locating a row's failure: the divergence in layout terms, else the failure text.
pub fn location(r: &Row) -> String {
    match &r.first_divergence {
        Some(d) => {
            let mut s = format!("step {} pos {} (mod tile {})", d.choice.step, d.position, d.position_mod_tile);
            if let (Some(b), Some(o)) = (d.block_index, d.offset_in_block) {
                s += &format!(" block {b}+{o}");
            }
            if d.pads_trimmed > 0 {
                s += &format!(" pads {}", d.pads_trimmed);
            }
            if d.batch_size > 1 {
                s += &format!(" row {}/{}", d.batch_row, d.batch_size);
            }
            if r.nan {
                s += " NaN";
            }
            s
        }
        None => r.failure.clone().unwrap_or_else(|| r.verdict.name().to_string()),
    }
}

fn outcome(fault: Fault, report: &Report) -> FaultOutcome {
    let mut scenarios: BTreeMap<String, Cell> = BTreeMap::new();
    for r in &report.rows {
        let cell = scenarios.entry(r.scenario.clone()).or_insert(Cell {
            worst: Verdict::Skipped,
            failed_rows: 0,
            rows: 0,
            first_row: None,
            location: None,
        });
        cell.rows += 1;
        if r.verdict.rank() > cell.worst.rank() {
            cell.worst = r.verdict;
        }
        if !r.pass && r.verdict != Verdict::Skipped {
            cell.failed_rows += 1;
            if cell.first_row.is_none() {
                cell.first_row = Some(r.id());
                cell.location = Some(location(r));
            }
        }
    }
    FaultOutcome { fault: fault.name().to_string(), caught: report.summary.failed > 0, scenarios, skipped: None }
}

/// Run `suite` clean and under each of `faults_to_plant`.
pub fn selftest(
    suite: &Suite,
    opts: &RunOptions,
    faults_to_plant: &[Fault],
    progress: &dyn Progress,
) -> (SelftestReport, Report) {
    let started = std::time::Instant::now();
    let clean = run_suite(suite, &RunOptions { faults: Faults::NONE, ..opts.clone() }, progress);
    let clean_failures: Vec<String> = clean
        .rows
        .iter()
        .filter(|r| !r.pass && r.verdict != Verdict::Skipped)
        .map(|r| format!("{}: {}", r.id(), r.failure.clone().unwrap_or_default()))
        .collect();
    // What ran clean is what a fault could show up in.
    let ran: Vec<&str> =
        clean.rows.iter().filter(|r| r.verdict != Verdict::Skipped).map(|r| r.scenario.as_str()).collect();
    let mut outcomes = Vec::new();
    for &f in faults_to_plant {
        let catching = catching_scenarios(f);
        let skipped = if !catching.iter().any(|s| ran.contains(&s.name())) {
            let names: Vec<&str> = catching.iter().map(|s| s.name()).collect();
            Some(format!("only {} can catch it, and none of them ran", names.join(", ")))
        } else {
            unexercised(f, &clean)
        };
        if let Some(why) = skipped {
            outcomes.push(FaultOutcome {
                fault: f.name().to_string(),
                caught: false,
                scenarios: BTreeMap::new(),
                skipped: Some(why),
            });
            continue;
        }
        let report = run_suite(suite, &RunOptions { faults: Faults::only(f), ..opts.clone() }, progress);
        outcomes.push(outcome(f, &report));
    }
    let report = SelftestReport {
        suite: suite.name.clone(),
        clean_passed: clean_failures.is_empty() && clean.summary.passed > 0,
        clean_failures,
        faults: outcomes,
        seconds: started.elapsed().as_secs_f64(),
    };
    (report, clean)
}

/// Every fault, in declaration order.
pub fn all_faults() -> Vec<Fault> {
    faults::ALL.to_vec()
}

/// The fault x scenario table.
pub fn render(r: &SelftestReport) -> String {
    let scenarios: Vec<String> = {
        let mut s: Vec<String> = r.faults.iter().flat_map(|f| f.scenarios.keys().cloned()).collect();
        s.sort();
        s.dedup();
        s
    };
    let mut out = String::new();
    out += &format!("selftest of suite `{}`\n", r.suite);
    out += &format!(
        "clean run: {}\n",
        if r.clean_passed { "PASS".to_string() } else { format!("FAIL ({} rows)", r.clean_failures.len()) }
    );
    for f in &r.clean_failures {
        out += &format!("  {f}\n");
    }
    let width = 12;
    out += &format!("\n{:<24} {:<8}", "fault", "caught");
    for s in &scenarios {
        out += &format!(" {s:<width$}");
    }
    out += "\n";
    for f in &r.faults {
        if let Some(why) = &f.skipped {
            out += &format!("{:<24} {:<8} {why}\n", f.fault, "skipped");
            continue;
        }
        out += &format!("{:<24} {:<8}", f.fault, if f.caught { "yes" } else { "NO" });
        for s in &scenarios {
            let cell = f.scenarios.get(s).map(|c| {
                if c.failed_rows > 0 { format!("{} {}/{}", short(c.worst), c.failed_rows, c.rows) } else { "-".into() }
            });
            out += &format!(" {:<width$}", cell.unwrap_or_default());
        }
        out += "\n";
    }
    out += "\nfirst failing row per fault and scenario:\n";
    for f in &r.faults {
        for (s, c) in &f.scenarios {
            if let (Some(row), Some(loc)) = (&c.first_row, &c.location) {
                out += &format!("  {:<22} {:<11} {row}: {loc}\n", f.fault, s);
            }
        }
    }
    let undetected: Vec<&str> = r.planted().filter(|f| !f.caught).map(|f| f.fault.as_str()).collect();
    let planted = r.planted().count();
    out += &format!(
        "\n{}: {} of {} faults caught, clean run {} ({:.1}s)\n",
        if r.ok() { "PASS" } else { "FAIL" },
        planted - undetected.len(),
        planted,
        if r.clean_passed { "passed" } else { "failed" },
        r.seconds
    );
    if !undetected.is_empty() {
        out += &format!("undetected: {}\n", undetected.join(", "));
    }
    let skipped: Vec<&str> = r.faults.iter().filter(|f| f.skipped.is_some()).map(|f| f.fault.as_str()).collect();
    if !skipped.is_empty() {
        out += &format!("skipped (its code path did not run): {}\n", skipped.join(", "));
    }
    out
}

fn short(v: Verdict) -> &'static str {
    match v {
        Verdict::Identical => "ident",
        Verdict::NearTie => "tie",
        Verdict::Within => "within",
        Verdict::Vacuous => "VAC",
        Verdict::Diverged => "DIV",
        Verdict::Error => "ERR",
        Verdict::Skipped => "skip",
    }
}
