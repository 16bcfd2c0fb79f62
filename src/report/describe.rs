//! How a row is described in words, shared by every rendering (terminal, JUnit, Markdown,
//! HTML), so a failure reads the same in a terminal, a CI test tab, a step summary and a
//! report file.

use std::fmt::Write;

use super::{CheckpointReport, DivergenceReport, Row};
use crate::compare::TOP_K;
use crate::vocab::{Distribution, Status, Verdict};

const VERDICTS: [Verdict; 7] = [
    Verdict::Identical,
    Verdict::Within,
    Verdict::NearTie,
    Verdict::Vacuous,
    Verdict::Diverged,
    Verdict::Error,
    Verdict::Skipped,
];

/// A row that counts as failed in the summary (see `Summary::of`).
pub fn failing(row: &Row) -> bool {
    !row.pass && row.verdict != Verdict::Skipped
}

/// Rows grouped by (checkpoint, scenario, backend), in order of first appearance, so the
/// table follows the suite file.
pub fn groups(rows: &[Row]) -> Vec<Vec<&Row>> {
    let mut out: Vec<Vec<&Row>> = Vec::new();
    for r in rows {
        let same =
            |g: &&mut Vec<&Row>| g[0].checkpoint == r.checkpoint && g[0].scenario == r.scenario && g[0].path == r.path;
        match out.iter_mut().find(same) {
            Some(g) => g.push(r),
            None => out.push(vec![r]),
        }
    }
    out
}

/// `12 identical, 1 near-tie`, verdicts in order of severity, zeros left out.
pub fn counts<'a>(rows: impl Iterator<Item = &'a Row> + Clone) -> String {
    let parts: Vec<String> = VERDICTS
        .iter()
        .filter_map(|&v| {
            let n = rows.clone().filter(|r| r.verdict == v).count();
            (n > 0).then(|| format!("{n} {}", v.name()))
        })
        .collect();
    if parts.is_empty() { "no rows".into() } else { parts.join(", ") }
}

/// What a group of rows showed for its claims, by status: `shown: batched, crosses-blocks;
/// missing: row-bytes (3 of 12)`. A claim every row holds is listed under `shown`; any other
/// status with how many rows had it. `None` when no row states a claim. `held_too`: list the
/// claims every row holds (the terminal and HTML do; a Markdown cell has room for problems only).
pub fn evidence_summary(rows: &[&Row], held_too: bool) -> Option<String> {
    let mut claims: Vec<&str> = Vec::new();
    for e in rows.iter().flat_map(|r| &r.evidence) {
        if !claims.contains(&e.claim.as_str()) {
            claims.push(&e.claim);
        }
    }
    if claims.is_empty() {
        return None;
    }
    let mut parts: Vec<String> = Vec::new();
    for status in [Status::Held, Status::Missing, Status::Unreported, Status::Waived] {
        let mut names = Vec::new();
        for claim in &claims {
            let with: Vec<&Row> =
                rows.iter().copied().filter(|r| r.evidence.iter().any(|e| e.claim == *claim)).collect();
            let n = with.iter().filter(|r| r.evidence.iter().any(|e| e.claim == *claim && e.status == status)).count();
            if status == Status::Held {
                if n == with.len() {
                    names.push(claim.to_string());
                }
            } else if n == with.len() {
                names.push(claim.to_string());
            } else if n > 0 {
                names.push(format!("{claim} ({n} of {})", with.len()));
            }
        }
        if names.is_empty() || (status == Status::Held && !held_too) {
            continue;
        }
        let label = if status == Status::Held { "shown" } else { status.name() };
        parts.push(format!("{label}: {}", names.join(", ")));
    }
    (!parts.is_empty()).then(|| parts.join("; "))
}

/// A row's claims, one per line: `held batched: up to 2 rows in one model call`.
pub fn evidence_lines(row: &Row) -> String {
    row.evidence.iter().map(|e| format!("{} {}: {}", e.status.name(), e.claim, e.seen)).collect::<Vec<_>>().join("\n")
}

/// Labelled facts about a failing row, most telling first; values may span lines.
pub fn details(row: &Row, checkpoint: Option<&CheckpointReport>) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    out.push(("failure", row.failure.clone().unwrap_or_else(|| row.verdict.name().to_string())));
    if row.evidence.iter().any(|e| e.status != Status::Held) {
        out.push(("evidence", evidence_lines(row)));
    }
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
    match (&row.api, &row.distribution) {
        (_, Some(d)) => {
            out.push(("distribution", distribution_line(d)));
            let bounds: Vec<String> = row
                .bounds
                .iter()
                .map(|b| {
                    let mark = if b.held { "held" } else { "BROKEN" };
                    format!("{} {:.4} {} {} ({mark})", b.name, b.measured, b.relation, b.limit)
                })
                .collect();
            out.push(("bounds", bounds.join("; ")));
        }
        (Some(api), _) if row.verdict != Verdict::Error => out.push(("logprobs", api_line(api, checkpoint))),
        (Some(_), _) => {}
        (None, _) if row.verdict != Verdict::Error => out.push(("rel RMS", rms(row))),
        (None, _) => {}
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

/// `KL mean 5.3e-4, p99 2.1e-3, max 2.7e-3; top-1 97.3%; ...` for one corpus row.
pub fn distribution_line(d: &Distribution) -> String {
    format!(
        "{} positions: KL mean {:.2e} ± {:.1e}, median {:.2e}, p99 {:.2e}, max {:.2e}; dp RMS {:.2e}, max {:.2e}; \
         top-1 {:.1}%, top-{} overlap {:.1}%",
        d.positions,
        d.kl.mean,
        d.kl.mean_se,
        d.kl.median,
        d.kl.p99,
        d.kl.max,
        d.dp_rms,
        d.dp_max,
        100.0 * d.top1_agree,
        d.topk,
        100.0 * d.topk_overlap
    )
}

/// The lossy paths of a report as one table (header first): per corpus row, the distribution
/// as `llama-perplexity --kl-divergence` prints it, and KL in its first and last position band
/// (a quantized cache's error grows with context). Empty when no row read a corpus.
pub fn distribution_table(rows: &[Row]) -> Vec<Vec<String>> {
    let lossy: Vec<(&Row, &Distribution)> = rows.iter().filter_map(|r| Some((r, r.distribution.as_ref()?))).collect();
    if lossy.is_empty() {
        return Vec::new();
    }
    let header = [
        "checkpoint",
        "path",
        "positions",
        "KL mean",
        "KL median",
        "KL p90",
        "KL p99",
        "KL max",
        "dp RMS",
        "dp max",
        "top-1",
        "top-k overlap",
        "KL mean early",
        "KL mean late",
        "bounds",
    ];
    let mut out = vec![header.iter().map(|h| h.to_string()).collect::<Vec<_>>()];
    for (r, d) in lossy {
        let band = |b: Option<&crate::vocab::Band>| {
            b.map_or("-".to_string(), |b| format!("{:.2e} (positions {}-{})", b.kl_mean, b.from, b.to))
        };
        let held = r.bounds.iter().filter(|b| b.held).count();
        out.push(vec![
            r.checkpoint.clone(),
            r.path.clone(),
            d.positions.to_string(),
            format!("{:.2e} ± {:.1e}", d.kl.mean, d.kl.mean_se),
            format!("{:.2e}", d.kl.median),
            format!("{:.2e}", d.kl.p90),
            format!("{:.2e}", d.kl.p99),
            format!("{:.2e}", d.kl.max),
            format!("{:.2e}", d.dp_rms),
            format!("{:.2e}", d.dp_max),
            format!("{:.2}%", 100.0 * d.top1_agree),
            format!("{:.1}% (k={})", 100.0 * d.topk_overlap, d.topk),
            band(d.by_position.first()),
            band(d.by_position.last()),
            format!("{held}/{} held", r.bounds.len()),
        ]);
    }
    out
}

/// The step with the largest relative RMS (NaN steps excluded).
pub fn worst_step(row: &Row) -> Option<(usize, f32)> {
    row.step_rel_rms.iter().enumerate().filter_map(|(i, v)| v.map(|v| (i, v))).max_by(|a, b| a.1.total_cmp(&b.1))
}

/// Where the path left its reference, in the terms of the cache layout: the position within
/// a tile and the block/offset are what tell a RoPE bug from a block-boundary bug.
pub fn location(d: &DivergenceReport, paths: usize, c: Option<&CheckpointReport>) -> String {
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
pub fn top2(top: &[(u32, f32)]) -> String {
    let parts: Vec<String> = top.iter().take(2).map(|(t, l)| format!("{t} ({l:.3})")).collect();
    format!("top-2 {}", parts.join(", "))
}

/// The largest relative RMS, next to what two correct runs differ by on this machine.
pub fn rms(row: &Row) -> String {
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

/// A request-level row's measurements: the logprob shift against its tolerance, the first
/// difference, and what the server said about the prompt.
pub fn api_line(api: &super::ApiFacts, c: Option<&CheckpointReport>) -> String {
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

pub fn first_line(reason: Option<&str>) -> &str {
    reason.and_then(|r| r.lines().next()).unwrap_or("no reason recorded")
}

pub fn plural(n: usize, word: &str) -> String {
    if n == 1 { format!("{n} {word}") } else { format!("{n} {word}s") }
}
