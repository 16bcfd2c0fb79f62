//! `parity merge`: one report from the JSON reports of a sharded run (`--shard I/N`).

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Args as ClapArgs;

use super::run::CommonArgs;
use super::{EXIT_FAIL, EXIT_USAGE};
use crate::report::Report;

#[derive(ClapArgs)]
pub struct Args {
    /// JSON reports written by `parity run --json` (one per shard).
    #[arg(required = true)]
    inputs: Vec<PathBuf>,
    /// Merged JSON report.
    #[arg(long)]
    json: Option<PathBuf>,
    #[arg(long)]
    junit: Option<PathBuf>,
    #[arg(long)]
    markdown: Option<PathBuf>,
    /// Self-contained HTML report.
    #[arg(long)]
    html: Option<PathBuf>,
}

pub fn run(a: Args) -> Result<ExitCode> {
    let out = CommonArgs { json: a.json, junit: a.junit, markdown: a.markdown, html: a.html, ..CommonArgs::default() };
    // An output that cannot be written is said before the inputs are read.
    if let Err(e) = out.check_outputs() {
        eprintln!("error: {e:#}");
        return Ok(ExitCode::from(EXIT_USAGE));
    }
    let mut reports = Vec::new();
    for p in &a.inputs {
        let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
        let r: Report =
            serde_json::from_str(&text).with_context(|| format!("{}: not a parity JSON report", p.display()))?;
        reports.push(r);
    }
    let merged = crate::report::merge::merge(reports).map_err(anyhow::Error::msg)?;
    out.write_reports(&merged)?;
    print!("{}", crate::report::table::render(&merged, super::color(std::io::stdout().is_terminal())));
    Ok(ExitCode::from(if merged.failed() { EXIT_FAIL } else { 0 }))
}
