//! JUnit XML for CI test tabs: one `<testsuite>` per checkpoint, one `<testcase>` per row.
//!
//! Rows that could not run (`error` verdict) are `<error>`s and rows that ran and failed are
//! `<failure>`s, so a CI dashboard tells a broken setup from a broken cache.

use std::fmt::Write;

use super::describe::{details, failing, first_line};
use super::escape::{xml as escape, xml_text};
use super::{CheckpointReport, Report, Row};
use crate::vocab::Verdict;

pub fn render(report: &Report) -> String {
    let mut out = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    let t = Tally::of(report.rows.iter());
    let _ = writeln!(
        out,
        "<testsuites name=\"{}\" tests=\"{}\" failures=\"{}\" errors=\"{}\" skipped=\"{}\" time=\"{:.3}\">",
        escape(&report.suite),
        t.tests,
        t.failures,
        t.errors,
        t.skipped,
        report.summary.seconds
    );
    for name in checkpoint_names(report) {
        let checkpoint = report.checkpoints.iter().find(|c| c.name == name);
        suite(&mut out, report, name, checkpoint);
    }
    out.push_str("</testsuites>\n");
    out
}

/// Checkpoints in report order, then any that only rows mention (a hand-edited or merged
/// report), so no row is dropped from the XML.
fn checkpoint_names(report: &Report) -> Vec<&str> {
    let mut names: Vec<&str> = report.checkpoints.iter().map(|c| c.name.as_str()).collect();
    for r in &report.rows {
        if !names.contains(&r.checkpoint.as_str()) {
            names.push(&r.checkpoint);
        }
    }
    names
}

fn suite(out: &mut String, report: &Report, name: &str, checkpoint: Option<&CheckpointReport>) {
    let rows = report.rows.iter().filter(|r| r.checkpoint == name);
    let t = Tally::of(rows.clone());
    // A fold from +0.0, not `sum()`: an empty float sum is -0.0 and would print `-0.000`.
    let time: f64 = checkpoint.map_or(0.0, |c| c.phases.iter().fold(0.0, |t, p| t + p.seconds));
    let _ = writeln!(
        out,
        "  <testsuite name=\"{}\" tests=\"{}\" failures=\"{}\" errors=\"{}\" skipped=\"{}\" time=\"{time:.3}\">",
        escape(name),
        t.tests,
        t.failures,
        t.errors,
        t.skipped
    );
    if let Some(c) = checkpoint {
        out.push_str("    <properties>\n");
        let mut props = vec![
            ("reference", c.reference.clone()),
            ("status", format!("{:?}", c.status).to_lowercase()),
            ("dtype", c.dtype.clone()),
            ("device", report.environment.device.clone()),
            ("mlx", report.environment.mlx_version.clone()),
            ("mlx_enable_tf32", report.environment.mlx_enable_tf32.clone().unwrap_or_else(|| "unset".into())),
        ];
        for (key, value) in [("backend", &report.environment.backend), ("gpu", &report.environment.gpu)] {
            if let Some(v) = value {
                props.push((key, v.clone()));
            }
        }
        // The device of a reference computed in a child (device parity: `builtin:dense@cpu`),
        // as the child said; `device` above is this process's.
        if let Some(re) = c.reference_engine.as_ref().filter(|e| e.kind != "builtin")
            && let Some(device) = &re.device
        {
            props.push(("reference_device", device.clone()));
        }
        if let Some(r) = &c.resolved {
            props.insert(1, ("resolved", r.clone()));
        }
        for (k, v) in props {
            let _ = writeln!(out, "      <property name=\"{k}\" value=\"{}\"/>", escape(&v));
        }
        out.push_str("    </properties>\n");
    }
    let classname = escape(&format!("{}.{}", report.suite, name));
    for row in rows {
        let _ = write!(out, "    <testcase classname=\"{classname}\" name=\"{}\" time=\"0\"", escape(&row.case_id()));
        let detail = |tag: &str, message: &str, body: &str| {
            format!(">\n      <{tag} message=\"{}\">{}</{tag}>\n    </testcase>\n", escape(message), xml_text(body))
        };
        if row.verdict == Verdict::Skipped {
            let reason = checkpoint.and_then(|c| c.reason.as_deref()).or(row.notes.first().map(String::as_str));
            let _ = write!(out, ">\n      <skipped message=\"{}\"/>\n    </testcase>\n", escape(first_line(reason)));
        } else if row.verdict == Verdict::Error {
            let message = row.failure.as_deref().unwrap_or("error");
            out.push_str(&detail("error", first_line(Some(message)), message));
        } else if failing(row) {
            let message = row.failure.as_deref().unwrap_or(row.verdict.name());
            out.push_str(&detail("failure", message, &body(row, checkpoint)));
        } else {
            out.push_str("/>\n");
        }
    }
    out.push_str("  </testsuite>\n");
}

/// The same facts as the terminal's failure block, one `label: value` per line.
fn body(row: &Row, checkpoint: Option<&CheckpointReport>) -> String {
    let mut s = String::from("\n");
    for (label, value) in details(row, checkpoint) {
        if label == "failure" {
            continue;
        }
        for line in value.lines() {
            let _ = writeln!(s, "{label}: {line}");
        }
    }
    s.push_str("      ");
    s
}

struct Tally {
    tests: usize,
    failures: usize,
    errors: usize,
    skipped: usize,
}

impl Tally {
    fn of<'a>(rows: impl Iterator<Item = &'a Row>) -> Tally {
        let mut t = Tally { tests: 0, failures: 0, errors: 0, skipped: 0 };
        for r in rows {
            t.tests += 1;
            match r.verdict {
                Verdict::Skipped => t.skipped += 1,
                Verdict::Error => t.errors += 1,
                _ if failing(r) => t.failures += 1,
                _ => {}
            }
        }
        t
    }
}
