//! The terminal summary printed at the end of `parity run`: one aligned line per
//! (checkpoint, scenario, backend), a block per failing row that says where in the layout the
//! path left its reference, skipped checkpoints, and a last line with the totals. A failure
//! is described in the words of [`super::describe`], as in every other rendering.

use std::fmt::Write;

use super::describe::{counts, details, evidence_summary, failing, first_line, groups, plural};
use super::snapshot::Change;
use super::{CheckpointReport, CheckpointStatus, Report, Row};
use crate::vocab::Verdict;

/// Indent of the detail lines under a `FAIL` header.
const INDENT: &str = "    ";

/// Column widths of the group lines: from the rows of a finished report, or from the suite
/// before anything ran (lines streamed as units finish stay aligned).
#[derive(Debug, Clone, Copy, Default)]
pub struct Widths {
    pub checkpoint: usize,
    pub scenario: usize,
    pub path: usize,
}

impl Widths {
    pub fn of(rows: &[Row]) -> Self {
        let w = |f: fn(&Row) -> &str| rows.iter().map(|r| f(r).len()).max().unwrap_or(0);
        Widths { checkpoint: w(|r| &r.checkpoint), scenario: w(|r| &r.scenario), path: w(|r| &r.path) }
    }
}

/// The whole summary: a line per (checkpoint, scenario, backend), then [`tail`].
pub fn render(report: &Report, color: bool) -> String {
    let mut out = String::new();
    if !report.faults.is_empty() {
        let _ = writeln!(out, "planted faults: {}", report.faults.join(", "));
        out.push('\n');
    }
    let widths = Widths::of(&report.rows);
    for g in &groups(&report.rows) {
        if let Some(line) = group_line(g, &widths, color) {
            out.push_str(&line);
        }
    }
    out.push_str(&tail(report, color));
    out
}

/// `PASS  checkpoint  scenario  backend  12 identical` for one group of rows; `None` for a
/// group of skipped rows only (an absent checkpoint gets one SKIP line in [`tail`]).
pub fn group_line(g: &[&Row], w: &Widths, color: bool) -> Option<String> {
    let paint = Paint(color);
    let first = g.first()?;
    if g.iter().all(|r| r.verdict == Verdict::Skipped) && g.iter().all(|r| r.case == "*") {
        return None;
    }
    let failed = g.iter().filter(|r| failing(r)).count();
    let status = if failed > 0 {
        paint.red("FAIL")
    } else if g.iter().all(|r| r.verdict == Verdict::Skipped) {
        paint.yellow("SKIP")
    } else {
        paint.green("PASS")
    };
    let mut counts = counts(g.iter().copied());
    if failed > 0 {
        let _ = write!(counts, "; {failed} failed");
    }
    if let Some(e) = evidence_summary(g, true) {
        let _ = write!(counts, "  [{e}]");
    }
    let (wc, ws, wb) = (w.checkpoint, w.scenario, w.path);
    Some(format!("{status}  {:wc$}  {:ws$}  {:wb$}  {counts}\n", first.checkpoint, first.scenario, first.path))
}

/// What follows the group lines: checkpoint errors, a block per failing row, skipped
/// checkpoints, where the time went, snapshot changes and the totals.
pub fn tail(report: &Report, color: bool) -> String {
    let paint = Paint(color);
    let mut out = String::new();
    for c in &report.checkpoints {
        if c.status != CheckpointStatus::Error {
            continue;
        }
        let n = report.rows.iter().filter(|r| r.checkpoint == c.name).count();
        let _ = writeln!(out, "\n{} {}: checkpoint error, {} not run", paint.red("FAIL"), c.name, plural(n, "row"));
        for line in c.reason.as_deref().unwrap_or("no reason recorded").lines() {
            let _ = writeln!(out, "{INDENT}{line}");
        }
    }
    for row in report.rows.iter().filter(|r| failing(r)) {
        let checkpoint = report.checkpoints.iter().find(|c| c.name == row.checkpoint);
        // A checkpoint that never ran failed all its rows for one reason, said once above.
        if checkpoint.is_some_and(|c| c.status == CheckpointStatus::Error) {
            continue;
        }
        let _ = writeln!(out, "\n{} {}", paint.red("FAIL"), row.id());
        for (label, value) in details(row, checkpoint) {
            for (k, line) in value.lines().enumerate() {
                let label = if k == 0 { label } else { "" };
                let text = format!("{INDENT}{label:11} {line}");
                // Only the padding is trimmed: a trailing space in a text diff is content.
                let text = if line.is_empty() { text.trim_end() } else { &text };
                let _ = writeln!(out, "{text}");
            }
        }
    }

    let skipped: Vec<&CheckpointReport> =
        report.checkpoints.iter().filter(|c| c.status == CheckpointStatus::Skipped).collect();
    if !skipped.is_empty() {
        out.push('\n');
    }
    for c in skipped {
        let _ = writeln!(out, "{} {}: {}", paint.yellow("SKIP"), c.name, first_line(c.reason.as_deref()));
    }

    api_summary(&mut out, report);
    distribution_summary(&mut out, report);

    // Where the time went, per checkpoint that ran: what a suite costs, phase by phase.
    let timed: Vec<&CheckpointReport> =
        report.checkpoints.iter().filter(|c| c.status == CheckpointStatus::Ran && !c.phases.is_empty()).collect();
    if !timed.is_empty() {
        out.push('\n');
    }
    let summed = report.summary.jobs.map(|n| format!(" (summed over {n} workers)")).unwrap_or_default();
    for c in timed {
        let _ = writeln!(out, "time  {}{summed}: {}", c.name, phase_line(c));
    }

    let s = &report.summary;
    out.push('\n');
    // Said every run: a reader must not take an absent snapshot change for a checked one.
    for c in report.checkpoints.iter().filter(|c| c.status == CheckpointStatus::Ran) {
        if let Some(why) = &c.no_snapshot {
            let _ = writeln!(out, "not snapshotted: {}: {why}", c.name);
        }
    }
    for name in &s.snapshot_changes {
        let _ = writeln!(out, "{}: {name}", Change::of(name, &s.snapshot_new).label());
    }
    let mut last = s.line();
    if let Some(shard) = report.shard {
        let _ = write!(last, " (shard {}/{})", shard.index, shard.count);
    }
    if let Some(n) = report.summary.jobs {
        let _ = write!(last, " in {n} workers");
    }
    let last = if report.failed() { paint.red(&last) } else { paint.green(&last) };
    let _ = writeln!(out, "{last}");
    out
}

/// `load 0.10s, reference 0.31s, single 0.20s, ...`: phases in order, a scenario's backends
/// summed (phases are named `<scenario> <backend>`).
fn phase_line(c: &CheckpointReport) -> String {
    let mut merged: Vec<(String, f64)> = Vec::new();
    for p in &c.phases {
        let name = p.name.split(' ').next().unwrap_or(&p.name).to_string();
        match merged.iter_mut().find(|(n, _)| *n == name) {
            Some((_, secs)) => *secs += p.seconds,
            None => merged.push((name, p.seconds)),
        }
    }
    merged.iter().map(|(n, s)| format!("{n} {s:.2}s")).collect::<Vec<_>>().join(", ")
}

/// The lossy paths' distributions over their corpus, one aligned line per row.
fn distribution_summary(out: &mut String, report: &Report) {
    let table = super::describe::distribution_table(&report.rows);
    let Some(header) = table.first() else { return };
    let widths: Vec<usize> =
        (0..header.len()).map(|c| table.iter().map(|r| r[c].chars().count()).max().unwrap_or(0)).collect();
    out.push_str(
        "\nlossy paths over their corpus (KL in nats; dp: change in the probability of the text's next token):\n",
    );
    for r in &table {
        let cells: Vec<String> = r.iter().zip(&widths).map(|(c, &w)| format!("{c:<w$}")).collect();
        let _ = writeln!(out, "  {}", cells.join("  ").trim_end());
    }
}

/// What the servers of request-level rows (kind = "openai") said about themselves: said once
/// for the whole run, since they are facts about the server, not about one row.
fn api_summary(out: &mut String, report: &Report) {
    let api: Vec<(&Row, &super::ApiFacts)> = report.rows.iter().filter_map(|r| Some((r, r.api.as_ref()?))).collect();
    if api.is_empty() {
        return;
    }
    out.push('\n');
    let presented: usize = api.iter().map(|(_, a)| a.presented_not_top1).sum();
    if presented > 0 {
        let _ = writeln!(
            out,
            "quirk: at {presented} steps the server presented a token other than the most probable of its own \
             top_logprobs as the chosen one; parity takes the most probable (temperature 0)"
        );
    }
    let miscounted: Vec<&&Row> = api
        .iter()
        .filter(|(_, a)| a.server_prompt_tokens.is_some_and(|n| n != a.prompt_tokens))
        .map(|(r, _)| r)
        .collect();
    if let Some(r) = miscounted.first() {
        let _ = writeln!(
            out,
            "tokenizer: in {} the server's prompt token count differs from parity's (e.g. {})",
            plural(miscounted.len(), "row"),
            r.id()
        );
    }
    let contradicted = api.iter().filter(|(_, a)| a.text_contradiction.is_some()).count();
    if contradicted > 0 {
        let _ = writeln!(
            out,
            "contradiction: in {} the server's text is not its own top-1 tokens",
            plural(contradicted, "row")
        );
    }
    let requests: usize = api.iter().map(|(r, _)| r.paths).sum();
    let (wall, own): (f64, f64) = api.iter().fold((0.0, 0.0), |(w, o), (_, a)| (w + a.seconds, o + a.parity_seconds));
    if requests > 0 {
        let _ = writeln!(
            out,
            "requests: {requests} measured, {:.2}s each on average; parity's own share {:.2} ms per request",
            wall / requests as f64,
            1e3 * own / requests as f64
        );
    }
}

struct Paint(bool);

impl Paint {
    fn wrap(&self, code: &str, s: &str) -> String {
        if self.0 { format!("\x1b[{code}m{s}\x1b[0m") } else { s.to_string() }
    }
    fn red(&self, s: &str) -> String {
        self.wrap("31", s)
    }
    fn green(&self, s: &str) -> String {
        self.wrap("32", s)
    }
    fn yellow(&self, s: &str) -> String {
        self.wrap("33", s)
    }
}
