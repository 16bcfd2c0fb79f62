//! The terminal summary printed at the end of `parity run`: one aligned line per
//! (checkpoint, scenario, backend), a block per failing row that says where in the layout the
//! path left its reference, skipped checkpoints, and a last line with the totals.
//!
//! The describing helpers here are shared with the JUnit and Markdown renderers so that a
//! failure reads the same in a terminal, a CI test tab and a step summary.

use std::fmt::Write;

use super::snapshot::Change;
use super::{CheckpointReport, CheckpointStatus, DivergenceReport, Report, Row};
use crate::compare::{TOP_K, Verdict};

const VERDICTS: [Verdict; 5] =
    [Verdict::Identical, Verdict::NearTie, Verdict::Diverged, Verdict::Error, Verdict::Skipped];

/// Indent of the detail lines under a `FAIL` header.
const INDENT: &str = "    ";

/// Column widths of the group lines: from the rows of a finished report, or from the suite
/// before anything ran (lines streamed as units finish stay aligned).
#[derive(Debug, Clone, Copy, Default)]
pub struct Widths {
    pub checkpoint: usize,
    pub scenario: usize,
    pub backend: usize,
}

impl Widths {
    pub fn of(rows: &[Row]) -> Self {
        let w = |f: fn(&Row) -> &str| rows.iter().map(|r| f(r).len()).max().unwrap_or(0);
        Widths { checkpoint: w(|r| &r.checkpoint), scenario: w(|r| &r.scenario), backend: w(|r| &r.backend) }
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
    let (wc, ws, wb) = (w.checkpoint, w.scenario, w.backend);
    Some(format!("{status}  {:wc$}  {:ws$}  {:wb$}  {counts}\n", first.checkpoint, first.scenario, first.backend))
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

    // Where the time went, per checkpoint that ran: what a suite costs, phase by phase.
    let timed: Vec<&CheckpointReport> =
        report.checkpoints.iter().filter(|c| c.status == CheckpointStatus::Ran && !c.phases.is_empty()).collect();
    if !timed.is_empty() {
        out.push('\n');
    }
    for c in timed {
        let _ = writeln!(out, "time  {}: {}", c.name, phase_line(c));
    }

    let s = &report.summary;
    out.push('\n');
    for name in &s.snapshot_changes {
        let _ = writeln!(out, "{}: {name}", Change::of(name, &s.snapshot_new).label());
    }
    let mut last = s.line();
    if let Some(shard) = report.shard {
        let _ = write!(last, " (shard {}/{})", shard.index, shard.count);
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

/// A row that counts as failed in the summary (see `Summary::of`).
pub(crate) fn failing(row: &Row) -> bool {
    !row.pass && row.verdict != Verdict::Skipped
}

/// Rows grouped by (checkpoint, scenario, backend), in order of first appearance, so the
/// table follows the suite file.
pub(crate) fn groups(rows: &[Row]) -> Vec<Vec<&Row>> {
    let mut out: Vec<Vec<&Row>> = Vec::new();
    for r in rows {
        let same = |g: &&mut Vec<&Row>| {
            g[0].checkpoint == r.checkpoint && g[0].scenario == r.scenario && g[0].backend == r.backend
        };
        match out.iter_mut().find(same) {
            Some(g) => g.push(r),
            None => out.push(vec![r]),
        }
    }
    out
}

/// `12 identical, 1 near-tie`, verdicts in order of severity, zeros left out.
pub(crate) fn counts<'a>(rows: impl Iterator<Item = &'a Row> + Clone) -> String {
    let parts: Vec<String> = VERDICTS
        .iter()
        .filter_map(|&v| {
            let n = rows.clone().filter(|r| r.verdict == v).count();
            (n > 0).then(|| format!("{n} {}", v.name()))
        })
        .collect();
    if parts.is_empty() { "no rows".into() } else { parts.join(", ") }
}

/// Labelled facts about a failing row, most telling first; values may span lines.
pub(crate) fn details(row: &Row, checkpoint: Option<&CheckpointReport>) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    out.push(("failure", row.failure.clone().unwrap_or_else(|| row.verdict.name().to_string())));
    if let Some(d) = &row.first_divergence {
        out.push(("divergence", location(d, row.paths, checkpoint)));
        let c = &d.choice;
        // The gap is between the reference's choice and the path's, which is not always the
        // reference's runner-up: name both tokens so the number cannot be misread.
        out.push((
            "reference",
            format!(
                "{}; its gap from {} to the path's {} is {:.3}",
                top2(&c.reference_top),
                c.reference_token,
                c.token,
                c.reference_gap
            ),
        ));
        let mutual = if c.mutual_top_k { "mutual" } else { "not mutual" };
        // The threshold is the observed shift unless the dtype's spacing floor raised it;
        // printing it only then keeps the common case to one number.
        let threshold = if c.tie_threshold > c.observed_shift {
            format!(" (tie threshold {:.3}: the dtype's spacing at these logits)", c.tie_threshold)
        } else {
            String::new()
        };
        out.push((
            "path",
            format!(
                "{}; logits shifted by up to {:.3}{threshold}, {mutual} top-{TOP_K}",
                top2(&c.top),
                c.observed_shift
            ),
        ));
    } else if !row.pass && row.verdict != Verdict::Error {
        // Same tokens, failed on RMS: point at the step where the logits drifted most.
        if let Some((step, v)) = worst_step(row) {
            out.push(("worst step", format!("step {step}: rel RMS {v:.3e} (tokens identical)")));
        }
    }
    match &row.api {
        Some(api) if row.verdict != Verdict::Error => out.push(("logprobs", api_line(api, checkpoint))),
        Some(_) => {}
        None if row.verdict != Verdict::Error => out.push(("rel RMS", rms(row))),
        None => {}
    }
    if let (Some(r), Some(t)) = (&row.reference_text, &row.text) {
        // Equal text under equal tokens says nothing the verdict did not; equal text under
        // different tokens is a tokenization flip, worth saying.
        if r != t {
            out.push(("text", super::diff::text_diff(r, t)));
        } else if row.tokens != row.reference_tokens {
            out.push(("text", "same decoded text, different tokens".into()));
        }
    }
    if !row.notes.is_empty() {
        out.push(("notes", row.notes.join("\n")));
    }
    out
}

/// The step with the largest relative RMS (NaN steps excluded).
pub(crate) fn worst_step(row: &Row) -> Option<(usize, f32)> {
    row.step_rel_rms.iter().enumerate().filter_map(|(i, v)| v.map(|v| (i, v))).max_by(|a, b| a.1.total_cmp(&b.1))
}

/// Where the path left its reference, in the terms of the cache layout: the position within
/// a tile and the block/offset are what tell a RoPE bug from a block-boundary bug.
pub(crate) fn location(d: &DivergenceReport, paths: usize, c: Option<&CheckpointReport>) -> String {
    let mut s = format!("step {}", d.choice.step);
    if paths > 1 {
        let _ = write!(s, ", path {} of {paths}", d.path);
    }
    let _ = write!(s, ", position {} ({} mod tile", d.position, d.position_mod_tile);
    if let Some(c) = c {
        let _ = write!(s, " {}", c.settings.tile);
    }
    let _ = write!(s, "), kv row {}", d.kv_row);
    if let (Some(b), Some(o)) = (d.block_index, d.offset_in_block) {
        let _ = write!(s, " (block {b} offset {o})");
    }
    if d.pads_trimmed > 0 {
        let _ = write!(s, ", {} trimmed", plural(d.pads_trimmed, "pad"));
    }
    let _ = write!(s, ", batch row {} of {}", d.batch_row, d.batch_size);
    s
}

/// `11 (14.250), 42 (13.750)`: token ids with their logits.
pub(crate) fn top2(top: &[(u32, f32)]) -> String {
    let parts: Vec<String> = top.iter().take(2).map(|(t, l)| format!("{t} ({l:.3})")).collect();
    format!("top-2 {}", parts.join(", "))
}

/// The largest relative RMS, next to what two correct runs differ by on this machine.
pub(crate) fn rms(row: &Row) -> String {
    let Some(m) = row.max_rel_rms else {
        return if row.nan { "NaN (a poisoned or freed row was read)".into() } else { "not measured".into() };
    };
    let mut s = format!("max {m:.3e}");
    match row.noise_floor_rel_rms {
        Some(f) if f > 0.0 => {
            let ratio = m / f;
            let ratio = if ratio >= 10.0 { format!("{ratio:.0}") } else { format!("{ratio:.1}") };
            let _ = write!(s, ", {ratio}x noise floor ({f:.3e})");
        }
        Some(_) => s.push_str(", floor 0"),
        None => s.push_str(", no noise floor"),
    }
    if let Some(kl) = row.max_kl {
        let _ = write!(s, "; max KL {kl:.3e}");
    }
    s
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

/// A request-level row's measurements: the logprob shift against its tolerance, the first
/// difference, and what the server said about the prompt.
pub(crate) fn api_line(api: &super::ApiFacts, c: Option<&CheckpointReport>) -> String {
    let mut s = format!("max |delta| {:.3e}", api.max_logprob_delta);
    if let Some(t) = c.and_then(|c| c.max_logprob_delta_tolerance) {
        let _ = write!(s, " (tolerance {t:.1e}{})", if c.is_some_and(|c| c.bitwise) { ", bitwise" } else { "" });
    }
    if let Some(d) = &api.first_difference {
        let v = |x: Option<f64>| x.map_or("absent".to_string(), |x| format!("{x:.6}"));
        let _ = write!(s, "; first difference step {} token {}: {} vs {}", d.step, d.token, v(d.reference), v(d.path));
    }
    let _ = write!(s, "\nprompt {} tokens (server: ", api.prompt_tokens);
    match api.server_prompt_tokens {
        Some(n) => {
            let _ = write!(s, "{n}");
        }
        None => s.push_str("not reported"),
    }
    if let Some(c) = api.cached_tokens {
        let _ = write!(s, ", {c} cached");
    }
    let _ = write!(s, "), finish {}", api.finish_reason.as_deref().unwrap_or("?"));
    s
}

pub(crate) fn first_line(reason: Option<&str>) -> &str {
    reason.and_then(|r| r.lines().next()).unwrap_or("no reason recorded")
}

pub(crate) fn plural(n: usize, word: &str) -> String {
    if n == 1 { format!("{n} {word}") } else { format!("{n} {word}s") }
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
