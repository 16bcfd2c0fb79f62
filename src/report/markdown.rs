//! Markdown for `$GITHUB_STEP_SUMMARY`: verdict counts per checkpoint as a scenario x backend
//! table, then one collapsed block per failure, skipped checkpoints and snapshot changes.
//!
//! Everything taken from the report (reasons, notes, decoded text) goes into code spans,
//! code blocks or escaped HTML, so a stray `*` or `<` in model output cannot reshape the page.

use std::fmt::Write;

use super::describe::{counts, details, evidence_summary, failing, first_line, groups, plural};
use super::snapshot::Change;
use super::{CheckpointStatus, Report, Row};
use crate::vocab::Verdict;

pub fn render(report: &Report) -> String {
    let mut out = String::new();
    let verdict = if report.failed() { "FAIL" } else { "PASS" };
    let _ = writeln!(out, "## parity {}: {verdict}\n", cell(&report.suite));
    let s = &report.summary;
    let _ = writeln!(out, "{}\n", s.line());
    let env = &report.environment;
    let mut meta = format!(
        "Suite {}, parity {}, MLX {} on {} ({}/{})",
        code(&report.suite_file),
        code(&if report.parity_commit.is_empty() {
            report.parity_version.clone()
        } else {
            format!("{} ({})", report.parity_version, report.parity_commit)
        }),
        code(&env.mlx_version),
        env.device_label(),
        env.os,
        env.arch
    );
    if let Some(blas) = &env.blas {
        let _ = write!(meta, ", BLAS {}", code(blas));
    }
    if let Some(allocator) = &env.allocator {
        let _ = write!(meta, ", malloc {}", code(allocator));
    }
    if let Some(jit) = &env.mlx_jit {
        let _ = write!(meta, ", MLX JIT {}", code(jit));
    }
    // Both sides of a device parity run, and the TF32 switch that moves CUDA float32 results.
    let _ = write!(meta, "{}, {}", env.references_line(), code(&env.tf32_line()));
    if let Some(shard) = report.shard {
        let _ = write!(meta, ", shard {}/{}", shard.index, shard.count);
    }
    let _ = writeln!(out, "{meta}.\n");
    if !report.faults.is_empty() {
        let faults: Vec<String> = report.faults.iter().map(|f| code(f)).collect();
        let _ = writeln!(out, "Planted faults: {}.\n", faults.join(", "));
    }

    let groups = groups(&report.rows);
    for c in &report.checkpoints {
        if c.status != CheckpointStatus::Ran {
            continue;
        }
        let mine: Vec<&Vec<&Row>> = groups.iter().filter(|g| g[0].checkpoint == c.name).collect();
        if mine.is_empty() {
            continue;
        }
        let _ = writeln!(out, "### {}\n", cell(&c.name));
        matrix(&mut out, &mine);
    }

    let lossy = super::describe::distribution_table(&report.rows);
    if let Some((header, rows)) = lossy.split_first() {
        out.push_str("### Lossy paths over their corpus\n\n");
        let _ = writeln!(out, "| {} |", header.join(" | "));
        let _ = writeln!(out, "|{}", " --- |".repeat(header.len()));
        for r in rows {
            let cells: Vec<String> = r.iter().map(|c| cell(c)).collect();
            let _ = writeln!(out, "| {} |", cells.join(" | "));
        }
        out.push('\n');
    }

    failures(&mut out, report);

    let skipped: Vec<_> = report.checkpoints.iter().filter(|c| c.status == CheckpointStatus::Skipped).collect();
    if !skipped.is_empty() {
        out.push_str("### Skipped checkpoints\n\n");
        for c in skipped {
            let _ = write!(out, "- {} ({}):", code(&c.name), code(&c.reference));
            match c.reason.as_deref() {
                Some(r) if r.lines().count() > 1 => {
                    out.push('\n');
                    out.push_str(&fenced(r, "  "));
                }
                r => {
                    let _ = writeln!(out, " {}", code(first_line(r)));
                }
            }
        }
        out.push('\n');
    }

    let unsnapshotted: Vec<_> = report
        .checkpoints
        .iter()
        .filter(|c| c.status == CheckpointStatus::Ran)
        .filter_map(|c| Some((&c.name, c.no_snapshot.as_ref()?)))
        .collect();
    if !unsnapshotted.is_empty() {
        out.push_str("### Not snapshotted\n\n");
        for (name, why) in unsnapshotted {
            let _ = writeln!(out, "- {}: {why}", code(name));
        }
        out.push('\n');
    }
    if !s.snapshot_changes.is_empty() {
        out.push_str("### Snapshot changes\n\n");
        for name in &s.snapshot_changes {
            let _ = writeln!(out, "- {}: {}", Change::of(name, &s.snapshot_new).label(), code(name));
        }
        out.push('\n');
    }
    out
}

/// Scenarios down, backends across, in order of first appearance.
fn matrix(out: &mut String, groups: &[&Vec<&Row>]) {
    let mut scenarios: Vec<&str> = Vec::new();
    let mut backends: Vec<&str> = Vec::new();
    for g in groups {
        if !scenarios.contains(&g[0].scenario.as_str()) {
            scenarios.push(&g[0].scenario);
        }
        if !backends.contains(&g[0].path.as_str()) {
            backends.push(&g[0].path);
        }
    }
    let head: Vec<String> = backends.iter().map(|b| cell(b)).collect();
    let _ = writeln!(out, "| scenario | {} |", head.join(" | "));
    let _ = writeln!(out, "|---|{}", "---|".repeat(backends.len()));
    for sc in &scenarios {
        let cells: Vec<String> = backends
            .iter()
            .map(|b| {
                let g = groups.iter().find(|g| g[0].scenario == *sc && g[0].path == *b);
                g.map_or_else(|| "-".to_string(), |g| status_cell(g))
            })
            .collect();
        let _ = writeln!(out, "| {} | {} |", cell(sc), cells.join(" | "));
    }
    out.push('\n');
}

fn status_cell(rows: &[&Row]) -> String {
    let failed = rows.iter().filter(|r| failing(r)).count();
    let mut counts = counts(rows.iter().copied());
    if let Some(e) = evidence_summary(rows, false) {
        counts = format!("{counts}; {e}");
    }
    if failed > 0 {
        format!("**FAIL** {}; {failed} failed", cell(&counts))
    } else if rows.iter().all(|r| r.verdict == Verdict::Skipped) {
        format!("SKIP {}", cell(&counts))
    } else {
        format!("PASS {}", cell(&counts))
    }
}

fn failures(out: &mut String, report: &Report) {
    let broken: Vec<_> = report.checkpoints.iter().filter(|c| c.status == CheckpointStatus::Error).collect();
    let is_broken = |r: &Row| broken.iter().any(|c| c.name == r.checkpoint);
    let rows: Vec<&Row> = report.rows.iter().filter(|r| failing(r) && !is_broken(r)).collect();
    if broken.is_empty() && rows.is_empty() {
        return;
    }
    out.push_str("### Failures\n\n");
    // A checkpoint that never ran failed all its rows for one reason: one block, not one per row.
    for c in broken {
        let n = report.rows.iter().filter(|r| r.checkpoint == c.name).count();
        let reason = c.reason.as_deref().unwrap_or("no reason recorded");
        let _ = writeln!(
            out,
            "<details>\n<summary><code>{}</code>: checkpoint error, {} not run</summary>\n",
            html(&c.name),
            plural(n, "row")
        );
        out.push_str(&fenced(reason, ""));
        out.push_str("\n</details>\n\n");
    }
    for row in rows {
        let checkpoint = report.checkpoints.iter().find(|c| c.name == row.checkpoint);
        let failure = row.failure.as_deref().unwrap_or(row.verdict.name());
        let _ = writeln!(
            out,
            "<details>\n<summary><code>{}</code>: {}</summary>\n",
            html(&row.id()),
            html(first_line(Some(failure)))
        );
        let mut parts: Vec<String> = Vec::new();
        // An error has nothing but its message: shown whole, unwrapped, as the body.
        if row.verdict == Verdict::Error || failure.lines().count() > 1 {
            parts.push(fenced(failure, ""));
        }
        let mut items = String::new();
        let mut diff = None;
        for (label, value) in details(row, checkpoint) {
            match label {
                "failure" => {}
                "text" if row.text != row.reference_text => diff = Some(value),
                _ => {
                    let values: Vec<String> = value.lines().map(code).collect();
                    let _ = writeln!(items, "- {label}: {}", values.join(", "));
                }
            }
        }
        if !items.is_empty() {
            parts.push(items);
        }
        if let Some(d) = diff {
            parts.push(format!("Decoded output, `[-reference-]{{+path+}}`:\n\n{}", fenced(&d, "")));
        }
        out.push_str(&parts.join("\n"));
        out.push_str("\n</details>\n\n");
    }
}

/// A fenced block whose fence is longer than any backtick run inside, so content cannot
/// close it early.
fn fenced(text: &str, indent: &str) -> String {
    let fence = "`".repeat(longest_backtick_run(text).max(2) + 1);
    let mut out = format!("{indent}{fence}text\n");
    for line in text.lines() {
        let _ = writeln!(out, "{indent}{line}");
    }
    let _ = writeln!(out, "{indent}{fence}");
    out
}

/// An inline code span, padded when the text itself starts or ends with a backtick.
fn code(s: &str) -> String {
    let ticks = "`".repeat(longest_backtick_run(s) + 1);
    let pad = if s.starts_with('`') || s.ends_with('`') { " " } else { "" };
    format!("{ticks}{pad}{s}{pad}{ticks}")
}

fn longest_backtick_run(s: &str) -> usize {
    s.split(|c| c != '`').map(str::len).max().unwrap_or(0)
}

/// Plain text in a heading or table cell.
fn cell(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if "\\`*_[]<>|#".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

fn html(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}
