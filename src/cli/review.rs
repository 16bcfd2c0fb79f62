//! `parity review` and `parity accept`: the snapshot workflow without cargo-insta.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Args as ClapArgs;

use crate::report::snapshot;

#[derive(ClapArgs)]
pub struct Args {
    /// A suite file (its snapshots) or a reports directory. Default: reports/.
    pub target: Option<PathBuf>,
    /// Where snapshot reports live, when TARGET is a suite (default: reports/ beside a suites/
    /// directory, else next to the suite file).
    #[arg(long)]
    pub reports: Option<PathBuf>,
}

fn directory(a: &Args) -> Result<PathBuf> {
    match &a.target {
        None => Ok(PathBuf::from("reports")),
        Some(t) if t.is_dir() => Ok(t.clone()),
        Some(t) => {
            let suite = crate::suite::load(t).map_err(|e| anyhow::anyhow!("{e}"))?;
            Ok(super::run::reports_dir(t, &a.reports).join(suite.name))
        }
    }
}

/// Show every pending change as a unified diff against the accepted snapshot.
pub fn review(a: Args) -> Result<ExitCode> {
    let dir = directory(&a)?;
    let pending = snapshot::pending(&dir);
    if pending.is_empty() {
        println!("no pending snapshots under {}", dir.display());
        return Ok(ExitCode::SUCCESS);
    }
    let color = std::io::stdout().is_terminal();
    for p in &pending {
        let accepted = snapshot::accepted_path(p);
        let old = std::fs::read_to_string(&accepted).unwrap_or_default();
        let new = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
        let diff = similar::TextDiff::from_lines(&old, &new);
        let title = if old.is_empty() { "new snapshot" } else { "changed snapshot" };
        println!("{title}: {}", accepted.display());
        for hunk in diff.unified_diff().context_radius(3).header("accepted", "pending").iter_hunks() {
            for line in hunk.to_string().lines() {
                let painted = match (color, line.chars().next()) {
                    (true, Some('+')) => format!("\x1b[32m{line}\x1b[0m"),
                    (true, Some('-')) => format!("\x1b[31m{line}\x1b[0m"),
                    _ => line.to_string(),
                };
                println!("{painted}");
            }
        }
        println!();
    }
    println!(
        "{} pending; accept with `parity accept {}`",
        pending.len(),
        a.target.as_ref().map(|t| t.display().to_string()).unwrap_or_default()
    );
    // Pending changes are unaccepted: say so in the exit code, as `parity run` does.
    Ok(ExitCode::from(super::EXIT_FAIL))
}

/// Accept every pending snapshot (rename `.snap.new` over `.snap`).
pub fn accept(a: Args) -> Result<ExitCode> {
    let dir = directory(&a)?;
    let pending = snapshot::pending(&dir);
    for p in &pending {
        let accepted = snapshot::accepted_path(p);
        std::fs::rename(p, &accepted).with_context(|| format!("accepting {}", p.display()))?;
        println!("accepted {}", accepted.display());
    }
    if pending.is_empty() {
        println!("no pending snapshots under {}", dir.display());
    }
    Ok(ExitCode::SUCCESS)
}
