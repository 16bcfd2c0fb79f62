//! `parity selftest [SUITE]`: the suite must pass clean and fail under every planted fault.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Args as ClapArgs;

use super::run::{Bars, CommonArgs};
use super::{EXIT_FAIL, EXIT_USAGE};
use crate::faults::Faults;
use crate::run::RunOptions;
use crate::selftest;

#[derive(ClapArgs)]
pub struct Args {
    /// Suite to check (default: suites/fixtures.toml).
    #[arg(default_value = "suites/fixtures.toml")]
    pub suite: PathBuf,
    /// Also write the clean run's reports (--json is the selftest table as JSON).
    /// `--fault` (repeatable) limits the faults planted; default: all.
    #[command(flatten)]
    pub common: CommonArgs,
}

pub fn run(a: Args) -> Result<ExitCode> {
    // An output that cannot be written is said before minutes of work.
    let suite = match super::run::prepare(&a.suite, &a.common) {
        Ok(s) => s,
        Err(code) => return Ok(code),
    };
    let to_plant = if a.common.faults.is_empty() { selftest::all_faults() } else { a.common.faults.clone() };
    let opts = RunOptions { faults: Faults::NONE, ..a.common.options() };
    if let Err(why) = crate::run::check_selection(&suite, &opts) {
        eprintln!("error: {why}");
        return Ok(ExitCode::from(EXIT_USAGE));
    }
    let (report, clean) = selftest::selftest(&suite, &opts, &to_plant, &Bars::new(&suite, false, None));
    if clean.rows.is_empty() {
        // Nothing ran, so nothing could be caught: never a pass.
        eprintln!("error: {}", crate::run::nothing_selected(&suite, &opts));
        return Ok(ExitCode::from(EXIT_USAGE));
    }
    print!("{}", selftest::render(&report));
    if report.planted().next().is_none() && !to_plant.is_empty() {
        // Every fault was outside the selection: nothing was checked, so never a pass.
        eprintln!("error: none of the faults asked for can be caught by the scenarios selected");
        return Ok(ExitCode::from(EXIT_USAGE));
    }
    if let Some(path) = &a.common.json {
        let json = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, json).with_context(|| format!("writing {}", path.display()))?;
    }
    let clean_reports = CommonArgs { json: None, ..a.common.clone() };
    clean_reports.write_reports(&clean)?;
    Ok(ExitCode::from(if report.ok() { 0 } else { EXIT_FAIL }))
}
