//! One self-contained HTML file a reviewer opens from a CI run: the run's header, a summary
//! table (failing groups first, each a link to its panel), a panel per failing row with the
//! divergence in layout terms, the per-step curve and the token strips, then small multiples
//! of every row's curve per checkpoint x scenario x path.
//!
//! No network: CSS is inline, the curves are inline SVG (see [`super::chart`]) and there is no
//! script (tooltips are SVG `<title>`s, expanding is `<details>`). A suite is untrusted input:
//! every string taken from the report goes through [`super::escape`]. Verdicts are never colour only:
//! each carries a symbol and a word.

use std::fmt::Write;

use super::chart::{Chart, Series, Size};
use super::describe::{
    counts, evidence_lines, evidence_summary, failing, first_line, groups, location, plural, rms, top2,
};
use super::escape::xml as esc;
use super::snapshot::Change;
use super::{CheckpointReport, CheckpointStatus, Report, Row};
use crate::compare::TOP_K;
use crate::vocab::Verdict;

const STYLE: &str = include_str!("html.css");

/// Status of a row or a group of rows, as a class, a symbol and a word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Pass,
    Fail,
    Skip,
}

impl Status {
    fn of(rows: &[&Row]) -> Status {
        if rows.iter().any(|r| failing(r)) {
            Status::Fail
        } else if rows.iter().all(|r| r.verdict == Verdict::Skipped) {
            Status::Skip
        } else {
            Status::Pass
        }
    }
    fn badge(self) -> &'static str {
        match self {
            Status::Pass => r#"<span class="badge pass">✓ PASS</span>"#,
            Status::Fail => r#"<span class="badge fail">✗ FAIL</span>"#,
            Status::Skip => r#"<span class="badge skip">– SKIP</span>"#,
        }
    }
}

fn verdict_badge(row: &Row) -> String {
    let (class, sym) = match row.verdict {
        Verdict::Identical => ("identical", "="),
        Verdict::NearTie => ("near-tie", "≈"),
        Verdict::Within => ("within", "~"),
        Verdict::Vacuous => ("vacuous", "∅"),
        Verdict::Diverged => ("diverged", "≠"),
        Verdict::Error => ("error", "!"),
        Verdict::Skipped => ("skipped", "–"),
    };
    let judged = if failing(row) { " fail" } else { "" };
    format!(r#"<span class="verdict v-{class}{judged}">{sym} {}</span>"#, row.verdict.name())
}

pub fn render(report: &Report) -> String {
    let mut out = String::with_capacity(64 * 1024);
    let status = if report.failed() { "FAIL" } else { "PASS" };
    let _ = write!(
        out,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>parity {}: {status}</title><style>{STYLE}</style></head><body>\n",
        esc(&report.suite)
    );
    header(&mut out, report);
    checkpoints(&mut out, report);

    let groups = groups(&report.rows);
    summary(&mut out, &groups);
    lossy(&mut out, report);
    failures(&mut out, report);
    multiples(&mut out, report, &groups);
    tail(&mut out, report);
    let _ = write!(
        out,
        "<footer>parity {} ({}) — one file, no network; hover a point for its step.</footer>\n</body></html>\n",
        esc(&report.parity_version),
        esc(&report.parity_commit)
    );
    out
}

fn header(out: &mut String, report: &Report) {
    let badge = if report.failed() { Status::Fail.badge() } else { Status::Pass.badge() };
    let exit = if report.failed() { 1 } else { 0 };
    let _ = writeln!(out, "<header><h1>parity · {} {badge}</h1>", esc(&report.suite));
    let _ = writeln!(out, "<p class=\"totals\">{} — exit {exit}</p>", esc(&report.summary.line()));
    let env = &report.environment;
    let commit = if report.parity_commit.is_empty() { "unknown" } else { &report.parity_commit };
    out.push_str("<dl class=\"meta\">");
    let mut item = |k: &str, v: String| {
        let _ = write!(out, "<dt>{k}</dt><dd>{v}</dd>");
    };
    item("suite", format!("<code>{}</code>", esc(&report.suite_file)));
    item("parity", format!("{} <code>{}</code>", esc(&report.parity_version), esc(commit)));
    item(
        "MLX",
        format!(
            "{} on <b>{}</b> ({}/{}){}{}{}",
            esc(&env.mlx_version),
            esc(&env.device_label()),
            esc(&env.os),
            esc(&env.arch),
            env.blas.as_ref().map(|b| format!(", BLAS {}", esc(b))).unwrap_or_default(),
            env.allocator.as_ref().map(|a| format!(", malloc {}", esc(a))).unwrap_or_default(),
            env.mlx_jit.as_ref().map(|j| format!(", MLX JIT {}", esc(j))).unwrap_or_default()
        ),
    );
    // Both sides of a device parity run, and the TF32 switch that moves CUDA float32 results.
    for (reference, device) in &env.reference_devices {
        item("reference", format!("<code>{}</code> on <b>{}</b>", esc(reference), esc(device)));
    }
    item("TF32", format!("<code>{}</code>", esc(&env.tf32_line())));
    if let Some(s) = report.shard {
        item("shard", format!("{}/{}", s.index, s.count));
    }
    if !report.faults.is_empty() {
        let f: Vec<String> = report.faults.iter().map(|f| format!("<code>{}</code>", esc(f))).collect();
        item("planted faults", f.join(", "));
    }
    out.push_str("</dl></header>\n");
}

fn engine_cell(c: &CheckpointReport) -> (String, String) {
    let engine = c.engine.as_ref().map_or_else(
        || "–".to_string(),
        |e| format!("{} <small>({} {})</small>", esc(&e.name), esc(&e.kind), esc(&e.version)),
    );
    let reference = match (&c.reference_engine, &c.reference_path) {
        (Some(e), Some(p)) => format!("{} / <code>{}</code>", esc(&e.name), esc(p)),
        (None, Some(p)) => format!("<code>{}</code>", esc(p)),
        (Some(e), None) => esc(&e.name),
        (None, None) => "–".into(),
    };
    (engine, reference)
}

fn checkpoints(out: &mut String, report: &Report) {
    out.push_str(
        "<section><h2>Checkpoints</h2><table class=\"grid\"><thead><tr><th>checkpoint</th><th>status</th>\
         <th>dtype</th><th>engine</th><th>reference</th><th>tolerance</th><th>block / tile</th>\
         <th>from</th></tr></thead><tbody>\n",
    );
    for c in &report.checkpoints {
        let status = match c.status {
            CheckpointStatus::Ran => r#"<span class="badge pass">✓ ran</span>"#.to_string(),
            CheckpointStatus::Skipped => format!(
                r#"<span class="badge skip">– skipped</span> <small>{}</small>"#,
                esc(first_line(c.reason.as_deref()))
            ),
            CheckpointStatus::Error => format!(
                r#"<span class="badge fail">✗ error</span> <small>{}</small>"#,
                esc(first_line(c.reason.as_deref()))
            ),
        };
        let dtype = if c.dequantized { format!("{} (dequantized)", esc(&c.dtype)) } else { esc(&c.dtype) };
        let (engine, reference) = engine_cell(c);
        let allowed: Vec<&str> = c.allowed_verdicts.iter().map(|v| v.name()).collect();
        let _ = writeln!(
            out,
            "<tr><td><b>{}</b></td><td>{status}</td><td>{dtype}</td><td>{engine}</td><td>{reference}</td>\
             <td>rel RMS ≤ {:.1e}; {}</td><td>{} / {}</td><td><code>{}</code></td></tr>",
            esc(&c.name),
            c.max_rel_rms_tolerance,
            esc(&allowed.join(", ")),
            c.settings.block_size,
            c.settings.tile,
            esc(c.resolved.as_deref().unwrap_or(&c.reference)),
        );
    }
    out.push_str("</tbody></table></section>\n");
}

/// A line per checkpoint x scenario x path, failing first, each linking to its panel.
fn summary(out: &mut String, groups: &[Vec<&Row>]) {
    let mut order: Vec<usize> = (0..groups.len()).collect();
    order.sort_by_key(|&i| match Status::of(&groups[i]) {
        Status::Fail => 0,
        Status::Pass => 1,
        Status::Skip => 2,
    });
    // Reports made before rows carried evidence (merged, or read back) get no empty column.
    let evidence = groups.iter().flatten().any(|r| !r.evidence.is_empty());
    let _ = writeln!(
        out,
        "<section><h2>Summary</h2><table class=\"grid summary\"><thead><tr><th>status</th><th>checkpoint</th>\
         <th>scenario</th><th>path</th><th>rows</th><th>max rel RMS</th>{}</tr></thead><tbody>",
        if evidence { "<th>evidence</th>" } else { "" },
    );
    for i in order {
        let g = &groups[i];
        let st = Status::of(g);
        let failed = g.iter().filter(|r| failing(r)).count();
        let mut n = counts(g.iter().copied());
        if failed > 0 {
            let _ = write!(n, "; {failed} failed");
        }
        let worst = g.iter().filter_map(|r| r.max_rel_rms).fold(None::<f32>, |m, v| Some(m.map_or(v, |m| m.max(v))));
        let nan = g.iter().any(|r| r.nan);
        let worst = match (worst, nan) {
            (_, true) => "NaN".to_string(),
            (Some(w), _) => format!("{w:.2e}"),
            (None, _) => "–".into(),
        };
        let class = match st {
            Status::Fail => "fail",
            Status::Pass => "pass",
            Status::Skip => "skip",
        };
        let _ = writeln!(
            out,
            "<tr class=\"{class}\"><td><a href=\"#g{i}\">{}</a></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{worst}</td>{}</tr>",
            st.badge(),
            esc(&g[0].checkpoint),
            esc(&g[0].scenario),
            esc(&g[0].path),
            esc(&n),
            if evidence {
                format!("<td>{}</td>", esc(&evidence_summary(g, true).unwrap_or_default()))
            } else {
                String::new()
            },
        );
    }
    out.push_str("</tbody></table></section>\n");
}

fn failures(out: &mut String, report: &Report) {
    let broken: Vec<&CheckpointReport> =
        report.checkpoints.iter().filter(|c| c.status == CheckpointStatus::Error).collect();
    let is_broken = |r: &Row| broken.iter().any(|c| c.name == r.checkpoint);
    let rows: Vec<(usize, &Row)> =
        report.rows.iter().enumerate().filter(|(_, r)| failing(r) && !is_broken(r)).collect();
    if broken.is_empty() && rows.is_empty() {
        return;
    }
    let _ = writeln!(out, "<section><h2>Failures ({})</h2>", rows.len() + broken.len());
    for c in broken {
        let n = report.rows.iter().filter(|r| r.checkpoint == c.name).count();
        let _ = writeln!(
            out,
            "<details open class=\"panel fail\"><summary>{} <code>{}</code>: checkpoint error, {} not run</summary><pre>{}</pre></details>",
            Status::Fail.badge(),
            esc(&c.name),
            plural(n, "row"),
            esc(c.reason.as_deref().unwrap_or("no reason recorded"))
        );
    }
    for (n, (i, row)) in rows.into_iter().enumerate() {
        let checkpoint = report.checkpoints.iter().find(|c| c.name == row.checkpoint);
        panel(out, i, row, checkpoint, n < OPEN_PANELS);
    }
    out.push_str("</section>\n");
}

/// Failing rows shown expanded; past these (a fault that fails everything), collapsed.
const OPEN_PANELS: usize = 12;

/// A failing row, expanded: what failed, where, the curve and the tokens.
fn panel(out: &mut String, i: usize, row: &Row, checkpoint: Option<&CheckpointReport>, open: bool) {
    let failure = row.failure.as_deref().unwrap_or(row.verdict.name());
    let open = if open { " open" } else { "" };
    let _ = writeln!(
        out,
        "<details{open} class=\"panel fail\" id=\"r{i}\"><summary>{} <code>{}</code> {}</summary>",
        Status::Fail.badge(),
        esc(&row.id()),
        verdict_badge(row)
    );
    let _ = writeln!(out, "<p class=\"failure\">{}</p>", esc(failure));
    out.push_str("<dl class=\"facts\">");
    if let Some(d) = &row.first_divergence {
        let c = &d.choice;
        let _ = write!(out, "<dt>divergence</dt><dd>{}</dd>", esc(&location(d, row.paths, checkpoint)));
        let _ = write!(out, "<dt>tokens</dt><dd>reference <b>{}</b>, path <b>{}</b></dd>", c.reference_token, c.token);
        let _ = write!(out, "<dt>reference</dt><dd>{}; gap {:.3}</dd>", esc(&top2(&c.reference_top)), c.reference_gap);
        let mutual = if c.mutual_top_k { "mutual" } else { "not mutual" };
        let _ = write!(
            out,
            "<dt>path</dt><dd>{}; shift {:.3}, tie threshold {:.3}, {mutual} top-{TOP_K}</dd>",
            esc(&top2(&c.top)),
            c.observed_shift,
            c.tie_threshold
        );
    }
    if row.verdict != Verdict::Error {
        let _ = write!(out, "<dt>rel RMS</dt><dd>{}</dd>", esc(&rms(row)));
    }
    if let Some(kv) = &row.kv {
        let _ = write!(
            out,
            "<dt>KV</dt><dd>{} bytes live, {} in use (peak {}), {} reserved; blocks {} in use (peak {}), {} reserved</dd>",
            kv.bytes_live,
            kv.bytes_in_use,
            kv.peak_bytes_in_use,
            kv.bytes_reserved,
            kv.blocks_in_use,
            kv.peak_blocks_in_use,
            kv.blocks_reserved
        );
    }
    if !row.notes.is_empty() {
        let _ = write!(out, "<dt>notes</dt><dd>{}</dd>", esc(&row.notes.join("; ")));
    }
    if !row.evidence.is_empty() {
        let _ = write!(
            out,
            "<dt>evidence</dt><dd>{}</dd>",
            evidence_lines(row).lines().map(esc).collect::<Vec<_>>().join("<br>")
        );
    }
    out.push_str("</dl>\n");
    if let Some(series) = series(row, checkpoint) {
        out.push_str(&chart(row, &series, checkpoint, Size::Full));
        out.push_str(&legend(series.name));
    }
    tokens(out, row);
    if let (Some(r), Some(t)) = (&row.reference_text, &row.text)
        && r != t
    {
        let _ = writeln!(
            out,
            "<p class=\"textdiff\"><b>decoded</b> <small>([-reference-]{{+path+}})</small><br><code>{}</code></p>",
            esc(&super::diff::text_diff(r, t))
        );
    }
    out.push_str("</details>\n");
}

/// The full chart's key: the curve is named for what it plots (a server row plots logprobs).
fn legend(curve: &str) -> String {
    format!(
        "<p class=\"legend\"><span class=\"k curve\">● {curve}</span> \
         <span class=\"k tol\">— tolerance</span> <span class=\"k floor\">▮ noise floor</span> \
         <span class=\"k div\">◆ first divergence</span> <span class=\"k g-block\">┆ block</span> \
         <span class=\"k g-tile\">┆ tile</span> <span class=\"k g-trim\">┆ trim/rewind</span></p>\n"
    )
}

/// What the row's chart plots, or `None` when it has nothing per step (it never ran).
fn series(row: &Row, checkpoint: Option<&CheckpointReport>) -> Option<Series> {
    Series::of(
        row,
        checkpoint.map_or(0.0, |c| c.max_rel_rms_tolerance),
        checkpoint.and_then(|c| c.max_logprob_delta_tolerance),
    )
}

fn chart(row: &Row, series: &Series, checkpoint: Option<&CheckpointReport>, size: Size) -> String {
    let tile = checkpoint.map_or(0, |c| c.settings.tile);
    Chart { row, series, tile, size }.svg()
}

/// Reference and path tokens, step by step; the steps where they differ are marked with a
/// symbol as well as a colour.
fn tokens(out: &mut String, row: &Row) {
    let n = row.tokens.len().max(row.reference_tokens.len());
    if n == 0 {
        return;
    }
    let cell = |v: Option<&u32>| v.map_or_else(String::new, u32::to_string);
    let mut steps = String::from("<tr><th>step</th>");
    let mut reference = String::from("<tr><th>reference</th>");
    let mut path = String::from("<tr><th>path</th>");
    for k in 0..n {
        let (r, p) = (row.reference_tokens.get(k), row.tokens.get(k));
        let differs = r != p;
        let class = if differs { " class=\"d\"" } else { "" };
        let mark = if differs { "≠" } else { "" };
        let _ = write!(steps, "<td{class}>{k}{mark}</td>");
        let _ = write!(reference, "<td{class}>{}</td>", cell(r));
        let _ = write!(path, "<td{class}>{}</td>", cell(p));
    }
    let _ = writeln!(out, "<div class=\"tokens\"><table>{steps}</tr>{reference}</tr>{path}</tr></table></div>");
}

/// Every group's rows as small multiples; failing groups open.
/// Lossy paths (`corpus` rows): the distribution table, then per checkpoint its KL
/// percentiles and KL by position as a chart.
fn lossy(out: &mut String, report: &Report) {
    let table = super::describe::distribution_table(&report.rows);
    let Some((header, rows)) = table.split_first() else { return };
    out.push_str("<section><h2>Lossy paths over their corpus</h2>\n<table><thead><tr>");
    for h in header {
        let _ = write!(out, "<th>{}</th>", esc(h));
    }
    out.push_str("</tr></thead><tbody>\n");
    for r in rows {
        out.push_str("<tr>");
        for c in r {
            let _ = write!(out, "<td>{}</td>", esc(c));
        }
        out.push_str("</tr>\n");
    }
    out.push_str("</tbody></table>\n");
    let mut names: Vec<&str> = Vec::new();
    for r in report.rows.iter().filter(|r| r.distribution.is_some()) {
        if !names.contains(&r.checkpoint.as_str()) {
            names.push(&r.checkpoint);
        }
    }
    for name in names {
        let paths: Vec<(&str, &crate::vocab::Distribution)> = report
            .rows
            .iter()
            .filter(|r| r.checkpoint == name)
            .filter_map(|r| Some((r.path.as_str(), r.distribution.as_ref()?)))
            .collect();
        let _ = writeln!(out, "<h3>{}</h3>{}", esc(name), super::chart::lossy_svg(name, &paths));
    }
    out.push_str("</section>\n");
}

fn multiples(out: &mut String, report: &Report, groups: &[Vec<&Row>]) {
    out.push_str("<section><h2>All rows</h2>\n");
    for (i, g) in groups.iter().enumerate() {
        let st = Status::of(g);
        let head = format!(
            "<details class=\"group\" id=\"g{i}\"{}><summary>{} {} / {} / {} <small>{}</small></summary>",
            if st == Status::Fail { " open" } else { "" },
            st.badge(),
            esc(&g[0].checkpoint),
            esc(&g[0].scenario),
            esc(&g[0].path),
            esc(&counts(g.iter().copied()))
        );
        let checkpoint = report.checkpoints.iter().find(|c| c.name == g[0].checkpoint);
        if st == Status::Skip && g.iter().all(|r| r.case == "*") && g.iter().all(|r| series(r, checkpoint).is_none()) {
            // An absent checkpoint: said once under Checkpoints.
            let _ = writeln!(out, "{head}</details>");
            continue;
        }
        let _ = writeln!(out, "{head}<div class=\"multiples\">");
        for row in g {
            let index = report.rows.iter().position(|r| std::ptr::eq(r, *row)).unwrap_or(0);
            let title = format!("{}/{}:{}", row.prompt, row.case, row.path);
            let link = if failing(row) && !checkpoint.is_some_and(|c| c.status == CheckpointStatus::Error) {
                format!(" <a href=\"#r{index}\">details</a>")
            } else {
                String::new()
            };
            let fail = if failing(row) { " fail" } else { "" };
            let _ = write!(
                out,
                "<figure class=\"card{fail}\" id=\"c{index}\"><figcaption><code>{}</code> {}{link}</figcaption>",
                esc(&title),
                verdict_badge(row)
            );
            match series(row, checkpoint) {
                Some(s) => out.push_str(&chart(row, &s, checkpoint, Size::Small)),
                None => {
                    let why = row.failure.as_deref().or(row.notes.first().map(String::as_str));
                    let _ = write!(out, "<p class=\"why\">{}</p>", esc(first_line(why)));
                }
            }
            out.push_str("</figure>\n");
        }
        out.push_str("</div></details>\n");
    }
    out.push_str("</section>\n");
}

fn tail(out: &mut String, report: &Report) {
    let changes = &report.summary.snapshot_changes;
    if changes.is_empty() {
        return;
    }
    out.push_str("<section><h2>Snapshot changes</h2><ul>");
    for c in changes {
        let label = Change::of(c, &report.summary.snapshot_new).label();
        let _ = write!(out, "<li>{label}: <code>{}</code></li>", esc(c));
    }
    out.push_str(
        "</ul><p>Review with <code>parity review</code>, accept with <code>parity accept</code>.</p></section>\n",
    );
}
