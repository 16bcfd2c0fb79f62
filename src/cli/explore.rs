//! `parity explore SUITE`: random schedules on every path of every checkpoint against its
//! reference, each failing one shrunk to a minimal script, reported as `run` reports (same
//! formats, same exit codes) with the reproducer to pin on the row.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use clap::Args as ClapArgs;

use super::run::{Bars, CommonArgs, Stream};
use super::{EXIT_FAIL, EXIT_USAGE};
use crate::report::table;
use crate::run::run_suite;
use crate::scenario::explore::Budget;

#[derive(ClapArgs)]
pub struct Args {
    /// Suite file (TOML): its checkpoints, engines, paths, prompts and settings (its scenarios
    /// are not run).
    pub suite: PathBuf,
    #[command(flatten)]
    pub common: CommonArgs,
    /// Seed: the same seed gives the same schedules and verdicts on the same build (a nightly
    /// passes the date).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Schedules per path (default 100 unless --time is given).
    #[arg(long)]
    pub schedules: Option<usize>,
    /// Time per path: `90s`, `5m`, `1h`, or seconds; with --schedules, whichever ends first.
    #[arg(long, value_parser = parse_duration)]
    pub time: Option<Duration>,
    /// Operations per schedule.
    #[arg(long, default_value_t = 16)]
    pub ops: usize,
    /// Most sequences live at once.
    #[arg(long, default_value_t = 4)]
    pub sequences: usize,
    /// Stop a path after this many distinct failures.
    #[arg(long, default_value_t = 3)]
    pub findings: usize,
}

fn parse_duration(s: &str) -> std::result::Result<Duration, String> {
    let (n, unit) = match s.char_indices().find(|(_, c)| !c.is_ascii_digit() && *c != '.') {
        Some((i, _)) => (&s[..i], &s[i..]),
        None => (s, "s"),
    };
    let n: f64 = n.parse().map_err(|_| format!("`{s}`: expected a number with s, m or h (e.g. 90s, 5m)"))?;
    let scale = match unit {
        "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        _ => return Err(format!("`{s}`: unknown unit `{unit}` (s, m or h)")),
    };
    if !(n.is_finite() && n > 0.0 && n * scale <= 7.0 * 86_400.0) {
        return Err(format!("`{s}`: must be positive and at most a week"));
    }
    Ok(Duration::from_secs_f64(n * scale))
}

pub fn run(a: Args) -> Result<ExitCode> {
    // An output that cannot be written is said before minutes of work.
    let suite = match super::run::prepare(&a.suite, &a.common) {
        Ok(s) => s,
        Err(code) => return Ok(code),
    };
    if a.ops == 0 || a.sequences == 0 || a.findings == 0 || a.schedules == Some(0) {
        eprintln!("error: --ops, --sequences, --findings and --schedules must be positive");
        return Ok(ExitCode::from(EXIT_USAGE));
    }
    if !a.common.scenarios.is_empty() {
        eprintln!("error: explore runs random schedules, not a suite's scenarios: --scenario does not apply");
        return Ok(ExitCode::from(EXIT_USAGE));
    }
    let mut opts = a.common.options();
    // Servers under test log where `run` puts their logs: a finding's server output is there.
    opts.server_logs = Some(super::run::reports_dir(&a.suite, &None).join(&suite.name).join("logs"));
    opts.explore = Some(Budget {
        seed: a.seed,
        schedules: a.schedules,
        time: a.time,
        ops: a.ops,
        sequences: a.sequences,
        findings: a.findings,
        ..Budget::default()
    });
    if let Err(why) = crate::run::check_selection(&suite, &opts) {
        eprintln!("error: {why}");
        return Ok(ExitCode::from(EXIT_USAGE));
    }
    let human = if a.common.stdout_taken() { Stream::Stderr } else { Stream::Stdout };
    let color = super::color(human.is_terminal());
    let report = run_suite(&suite, &opts, &Bars::new(&suite, color, Some(human)));
    if report.rows.is_empty() {
        eprintln!("error: {}", crate::run::nothing_selected(&suite, &opts));
        return Ok(ExitCode::from(EXIT_USAGE));
    }
    a.common.write_reports(&report)?;
    human.print(&table::tail(&report, color));
    Ok(ExitCode::from(if report.summary.failed > 0 { EXIT_FAIL } else { 0 }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_people_write_them() {
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("1.5h"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("30"), Ok(Duration::from_secs(30)));
        for bad in ["", "0s", "-3s", "5d", "m", "9999h"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }
}
