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
    /// Only these snapshots (repeatable): a file name as `review` prints it, with or without
    /// `.snap`, e.g. `qwen3-tiny__batch2`.
    #[arg(long = "only", value_name = "SNAPSHOT")]
    pub only: Vec<String>,
}

/// The pending snapshots `a` is about; an `--only` that names nothing pending is an error,
/// never a silent no-op.
fn selected(a: &Args, dir: &std::path::Path) -> Result<Vec<PathBuf>> {
    let pending = snapshot::pending(dir);
    if a.only.is_empty() {
        return Ok(pending);
    }
    let stem = |p: &PathBuf| {
        snapshot::accepted_path(p).file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default()
    };
    let mut out = Vec::new();
    for name in &a.only {
        let want = name.trim_end_matches(".new").trim_end_matches(".snap");
        let hit: Vec<PathBuf> = pending.iter().filter(|p| stem(p) == want).cloned().collect();
        anyhow::ensure!(
            !hit.is_empty(),
            "--only {name}: no pending snapshot of that name under {} (pending: {})",
            dir.display(),
            if pending.is_empty() { "none".into() } else { pending.iter().map(stem).collect::<Vec<_>>().join(", ") }
        );
        out.extend(hit);
    }
    Ok(out)
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

/// Show every pending change as a unified diff against the accepted snapshot. Reviewing is
/// reading: it exits 0 whatever is pending (as `cargo insta review` does), so
/// `parity review S && parity accept S` works; `parity run` is what fails on a change.
pub fn review(a: Args) -> Result<ExitCode> {
    let dir = directory(&a)?;
    let pending = selected(&a, &dir)?;
    if pending.is_empty() {
        println!("no pending snapshots under {}", dir.display());
        return Ok(ExitCode::SUCCESS);
    }
    let color = super::color(std::io::stdout().is_terminal());
    for p in &pending {
        let accepted = snapshot::accepted_path(p);
        let old = std::fs::read_to_string(&accepted).unwrap_or_default();
        let new = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
        let diff = similar::TextDiff::from_lines(&old, &new);
        let title = if accepted.exists() { snapshot::Change::Changed } else { snapshot::Change::New }.label();
        println!("{title}: {}", accepted.display());
        for hunk in diff.unified_diff().context_radius(3).header("accepted", "pending").iter_hunks() {
            // Name the row the first changed line is in; its prompt line may be out of context.
            let changed = hunk.ops().iter().find(|op| op.tag() != similar::DiffTag::Equal);
            let row = changed.and_then(|op| match op.tag() {
                similar::DiffTag::Delete => snapshot::row_of_line(&old, op.old_range().start),
                _ => snapshot::row_of_line(&new, op.new_range().start),
            });
            if let Some(row) = row {
                println!("row {row}");
            }
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
    let target = a.target.as_ref().map(|t| format!(" {}", t.display())).unwrap_or_default();
    println!(
        "{} pending; accept with `parity accept{target}`, reject with `parity reject{target}` (`--only NAME` for one)",
        pending.len()
    );
    Ok(ExitCode::SUCCESS)
}

/// Accept pending snapshots (rename `.snap.new` over `.snap`).
pub fn accept(a: Args) -> Result<ExitCode> {
    let dir = directory(&a)?;
    let pending = selected(&a, &dir)?;
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

/// Reject pending snapshots (delete the `.snap.new`; the accepted one stays).
pub fn reject(a: Args) -> Result<ExitCode> {
    let dir = directory(&a)?;
    let pending = selected(&a, &dir)?;
    for p in &pending {
        std::fs::remove_file(p).with_context(|| format!("rejecting {}", p.display()))?;
        println!("rejected {}", p.display());
    }
    if pending.is_empty() {
        println!("no pending snapshots under {}", dir.display());
    }
    Ok(ExitCode::SUCCESS)
}
