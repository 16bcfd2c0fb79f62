//! The per-step curve of one row as inline SVG, for the HTML report, on a log axis: relative
//! logit RMS for step engines (they expose logits), the largest |delta logprob| over the top-k
//! both sides returned for servers (kind = "openai": logprobs are all an API gives). The
//! tolerance is a line, the noise floor a band, the first divergence marked, and the steps
//! where the path crossed a block or tile boundary or was trimmed/rewound are vertical guides.
//! Each step carries a tooltip (`<title>`) with its value, KL and place, so the file needs no
//! script.
//!
//! Colours come from CSS classes of the page (light and dark themes); nothing here is a colour.

use std::fmt::Write;

use super::escape::xml;
use super::{Row, StepPlace};

/// What a step's guide says about where the path was when it was fed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Guide {
    /// The fed token opened a new KV block.
    Block,
    /// The fed token sits at a multiple of the tile.
    Tile,
    /// Rows were trimmed or the sequence rewound before this step.
    Trim,
}

impl Guide {
    fn class(self) -> &'static str {
        match self {
            Guide::Block => "g-block",
            Guide::Tile => "g-tile",
            Guide::Trim => "g-trim",
        }
    }
    fn name(self) -> &'static str {
        match self {
            Guide::Block => "block boundary",
            Guide::Tile => "tile boundary",
            Guide::Trim => "trim/rewind",
        }
    }
}

/// Guides per step, from the recorded layout (one place per step, see [`StepPlace::expand`]).
/// Step 0 is fed the last prompt token: a boundary
/// there is still a boundary; a trim there means pads were trimmed after prefill.
pub fn guides(layout: &[StepPlace], block_size: Option<usize>, tile: usize) -> Vec<(usize, Guide)> {
    let mut out = Vec::new();
    for (k, p) in layout.iter().enumerate() {
        let prev = k.checked_sub(1).map(|j| layout[j]);
        let moved = match prev {
            Some(q) => p.pads_trimmed != q.pads_trimmed || p.rolled_back != q.rolled_back || p.kv_row != q.kv_row + 1,
            None => p.pads_trimmed > 0,
        };
        if moved {
            out.push((k, Guide::Trim));
        }
        if block_size.is_some_and(|bs| p.kv_row % bs == 0) {
            out.push((k, Guide::Block));
        }
        if tile > 0 && p.position % tile == 0 {
            out.push((k, Guide::Tile));
        }
    }
    out
}

/// What a row's chart plots, per step, with the line and band it is judged against.
pub struct Series {
    pub values: Vec<Option<f32>>,
    pub tolerance: Option<f32>,
    pub floor: Option<f32>,
    /// Short name for tooltips and the legend.
    pub name: &'static str,
    /// What the chart's title says it shows.
    pub title: &'static str,
}

impl Series {
    /// Relative logit RMS when the row has it, else the row's |delta logprob| per step (a
    /// server's row), else nothing to draw (a row that never ran).
    pub fn of(row: &Row, rms_tolerance: f32, logprob_tolerance: Option<f32>) -> Option<Series> {
        let positive = |t: f32| (t > 0.0 && t.is_finite()).then_some(t);
        if !row.step_rel_rms.is_empty() {
            return Some(Series {
                values: row.step_rel_rms.clone(),
                tolerance: positive(rms_tolerance),
                floor: row.noise_floor_rel_rms.filter(|f| *f > 0.0 && f.is_finite()),
                name: "rel RMS",
                title: "relative logit RMS per step",
            });
        }
        let api = row.api.as_ref().filter(|a| !a.step_logprob_delta.is_empty())?;
        Some(Series {
            values: api.step_logprob_delta.iter().map(|&d| d.is_finite().then_some(d as f32)).collect(),
            tolerance: logprob_tolerance.and_then(positive),
            floor: None,
            name: "|Δ logprob|",
            title: "largest |Δ logprob| per step over the top-k both returned",
        })
    }
}

/// The size of a chart: `Full` for a failing row's panel, `Small` for the small multiples.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Size {
    Full,
    Small,
}

pub struct Chart<'a> {
    pub row: &'a Row,
    pub series: &'a Series,
    pub tile: usize,
    pub size: Size,
}

/// Decades shown at most: below that, everything reads as "equal".
const MAX_DECADES: i32 = 9;

impl Chart<'_> {
    pub fn svg(&self) -> String {
        let (row, series) = (self.row, self.series);
        let values = &series.values;
        let full = self.size == Size::Full;
        let (w, h, left, right, top, bottom) =
            if full { (640.0, 220.0, 52.0, 12.0, 14.0, 30.0) } else { (260.0, 110.0, 40.0, 6.0, 8.0, 18.0) };
        let n = values.len().max(1);
        let (plot_w, plot_h) = (w - left - right, h - top - bottom);
        let (x0, x1, y0, y1) = (N(left), N(w - right), N(top), N(top + plot_h));
        let x = |k: usize| N(left + if n == 1 { plot_w / 2.0 } else { plot_w * k as f64 / (n - 1) as f64 });

        // The y range: decades around every positive value, the tolerance and the floor.
        let (floor, tol) = (series.floor, series.tolerance);
        let positives: Vec<f64> = values
            .iter()
            .flatten()
            .chain(floor.iter())
            .chain(tol.iter())
            .filter(|v| **v > 0.0 && v.is_finite())
            .map(|v| f64::from(*v))
            .collect();
        let hi_val = positives.iter().copied().fold(f64::MIN, f64::max);
        let lo_val = positives.iter().copied().fold(f64::MAX, f64::min);
        let (mut lo, mut hi) = if positives.is_empty() {
            (-4, 0)
        } else {
            (lo_val.log10().floor() as i32 - 1, hi_val.log10().ceil() as i32)
        };
        if hi <= lo {
            hi = lo + 1;
        }
        lo = lo.max(hi - MAX_DECADES);
        let y = |v: f64| {
            let l = if v > 0.0 { v.log10().clamp(f64::from(lo), f64::from(hi)) } else { f64::from(lo) };
            N(top + plot_h * (f64::from(hi) - l) / f64::from(hi - lo))
        };

        let mut s = String::new();
        let _ = write!(
            s,
            r#"<svg class="chart {}" viewBox="0 0 {w} {h}" width="{w}" height="{h}" role="img">"#,
            if full { "full" } else { "small" }
        );
        let title =
            if full { format!("{} for {}", series.title, row.id()) } else { format!("{}: {}", row.id(), summary(row)) };
        let _ = write!(s, "<title>{}</title>", xml(&title));
        // Noise floor band: everything below it is what two correct runs differ by.
        if let Some(f) = floor {
            let yf = y(f64::from(f));
            let _ = write!(
                s,
                r#"<rect class="floor" x="{x0}" y="{yf}" width="{}" height="{}"><title>noise floor {f:.3e}</title></rect>"#,
                N(plot_w),
                N(top + plot_h - yf.0)
            );
        }
        // Decade grid (one path) and labels: every decade on the full chart; the ends and the
        // tolerance's decade on a small one (its shape is the point, and bytes add up).
        let tol_decade = tol.map(|t| f64::from(t).log10().round() as i32);
        let labelled = |d: i32| full || d == lo || d == hi || Some(d) == tol_decade;
        let mut grid = String::new();
        let mut labels = String::new();
        for d in lo..=hi {
            let yy = y(10f64.powi(d));
            let _ = write!(grid, "M{x0} {yy}H{x1}");
            if labelled(d) {
                let text = if d == lo { format!("≤1e{d}") } else { format!("1e{d}") };
                let _ = write!(labels, r#"<text class="ty" x="{}" y="{}">{text}</text>"#, N(left - 4.0), N(yy.0 + 3.5));
            }
        }
        let _ = write!(s, r#"<path class="grid" d="{grid}"/>{labels}"#);
        // Step ticks.
        let stride = if full { (n / 16).max(1) } else { (n - 1).max(1) };
        for k in (0..n).step_by(stride) {
            let _ = write!(s, r#"<text class="tx" x="{}" y="{}">{k}</text>"#, x(k), N(h - bottom + 12.0));
        }
        if full {
            let _ = write!(s, r#"<text class="ty" x="{x1}" y="{}">step</text>"#, N(h - 3.0));
        }
        // Layout guides: each with its tooltip on the full chart, one path per kind on a small one.
        let places = StepPlace::expand(&row.step_layout, values.len());
        let guides = guides(&places, row.block_size, self.tile);
        for kind in [Guide::Trim, Guide::Block, Guide::Tile] {
            let mut d = String::new();
            for &(k, g) in guides.iter().filter(|(_, g)| *g == kind) {
                if full {
                    let p = places[k];
                    let _ = write!(
                        s,
                        r#"<path class="guide {}" d="M{} {y0}V{y1}"><title>step {k}: {} (kv row {}, position {})</title></path>"#,
                        g.class(),
                        x(k),
                        g.name(),
                        p.kv_row,
                        p.position
                    );
                } else {
                    let _ = write!(d, "M{} {y0}V{y1}", x(k));
                }
            }
            if !d.is_empty() {
                let _ = write!(s, r#"<path class="guide {}" d="{d}"/>"#, kind.class());
            }
        }
        // Tolerance.
        if let Some(t) = tol {
            let yt = y(f64::from(t));
            let _ = write!(s, r#"<path class="tol" d="M{x0} {yt}H{x1}"><title>tolerance {t:.1e}</title></path>"#);
        }
        // First divergence.
        if let Some(d) = &row.first_divergence {
            let xd = x(d.choice.step.min(n - 1));
            let _ = write!(
                s,
                r#"<path class="div" d="M{xd} {y0}V{y1}"/><text class="div-label" x="{}" y="{}" data-step="{}">◆ step {}</text>"#,
                N(xd.0 + 3.0),
                N(top + 9.0),
                d.choice.step,
                d.choice.step
            );
        }
        // The curve: NaN steps break it and are marked at the top.
        let mut path = String::new();
        let mut pen_up = true;
        for (k, v) in values.iter().enumerate() {
            match v {
                Some(v) => {
                    let _ = write!(path, "{}{} {}", if pen_up { "M" } else { "L" }, x(k), y(f64::from(*v)));
                    pen_up = false;
                }
                None => pen_up = true,
            }
        }
        if !path.is_empty() {
            let _ = write!(s, r#"<path class="curve" d="{path}"/>"#);
        }
        // Points with their tooltips on the full chart; the small multiples mark only NaN steps
        // (a hover there would cost more bytes than the curve).
        for (k, v) in values.iter().enumerate() {
            let tip = || xml(&tooltip(row, series, places.get(k), k));
            match (v, full) {
                (Some(v), true) => {
                    let over = tol.is_some_and(|t| *v > t);
                    let _ = write!(
                        s,
                        r#"<circle class="pt{}" cx="{}" cy="{}" r="3"><title>{}</title></circle>"#,
                        if over { " over" } else { "" },
                        x(k),
                        y(f64::from(*v)),
                        tip()
                    );
                }
                (Some(_), false) => {}
                (None, true) => {
                    let _ = write!(
                        s,
                        r#"<text class="nan" x="{}" y="{}">NaN<title>{}</title></text>"#,
                        x(k),
                        N(top + 9.0),
                        tip()
                    );
                }
                (None, false) => {
                    let _ = write!(s, r#"<text class="nan" x="{}" y="{}">×</text>"#, x(k), N(top + 9.0));
                }
            }
        }
        let _ =
            write!(s, r#"<rect class="frame" x="{x0}" y="{y0}" width="{}" height="{}"/></svg>"#, N(plot_w), N(plot_h));
        s
    }
}

/// A coordinate, to a tenth of a pixel, without a trailing `.0`.
#[derive(Debug, Clone, Copy)]
struct N(f64);

impl std::fmt::Display for N {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let tenths = (self.0 * 10.0).round() as i64;
        if tenths % 10 == 0 { write!(f, "{}", tenths / 10) } else { write!(f, "{:.1}", tenths as f64 / 10.0) }
    }
}

/// The small chart's tooltip: the row's worst step and where it left its reference.
fn summary(row: &Row) -> String {
    let mut t = match &row.api {
        Some(api) if row.step_rel_rms.is_empty() => format!("max |Δ logprob| {:.3e}", api.max_logprob_delta),
        _ => super::describe::rms(row),
    };
    if let Some(d) = &row.first_divergence {
        let _ = write!(t, "; first divergence at step {} (position {})", d.choice.step, d.position);
    }
    t
}

fn tooltip(row: &Row, series: &Series, place: Option<&StepPlace>, k: usize) -> String {
    let mut t = format!("step {k}: {} ", series.name);
    match series.values.get(k).copied().flatten() {
        Some(v) => {
            let _ = write!(t, "{v:.3e}");
        }
        None => t.push_str("NaN"),
    }
    match row.step_kl.get(k) {
        Some(Some(kl)) => {
            let _ = write!(t, ", KL {kl:.3e}");
        }
        Some(None) => t.push_str(", KL NaN"),
        None => {}
    }
    if let Some(p) = place {
        let _ = write!(t, "; position {}, kv row {}", p.position, p.kv_row);
        if p.pads_trimmed > 0 {
            let _ = write!(t, ", {} pads trimmed", p.pads_trimmed);
        }
        if p.rolled_back > 0 {
            let _ = write!(t, ", {} rows rolled back", p.rolled_back);
        }
    }
    if let (Some(a), Some(b)) = (row.reference_tokens.get(k), row.tokens.get(k)) {
        if a == b {
            let _ = write!(t, "; token {a}");
        } else {
            let _ = write!(t, "; reference {a}, path {b}");
        }
    }
    t
}

/// A lossy checkpoint's paths as two panels: how KL is distributed over the corpus (its
/// percentiles, 0 to 100, one curve per path) and how it grows with context (mean KL per
/// position band). Log scale, the decades around what was measured; each point's tooltip says
/// its value. `paths`: (path name, distribution).
pub fn lossy_svg(checkpoint: &str, paths: &[(&str, &crate::vocab::Distribution)]) -> String {
    const PALETTE: [&str; 6] = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2"];
    let (w, h, left, right, top, bottom, gap) = (760.0, 240.0, 52.0, 12.0, 22.0, 34.0, 40.0);
    let panel_w = (w - left - right - gap) / 2.0;
    let plot_h = h - top - bottom;
    let positive = |v: f64| v > 0.0 && v.is_finite();
    let all: Vec<f64> = paths
        .iter()
        .flat_map(|(_, d)| d.kl_percentiles.iter().copied().chain(d.by_position.iter().map(|b| b.kl_mean)))
        .filter(|&v| positive(v))
        .collect();
    let (lo_v, hi_v) = all.iter().fold((f64::MAX, f64::MIN), |(a, b), &v| (a.min(v), b.max(v)));
    let (mut lo, hi) = if all.is_empty() {
        (-6, 0)
    } else {
        (lo_v.log10().floor() as i32, (hi_v.log10().ceil() as i32).max(lo_v.log10().floor() as i32 + 1))
    };
    lo = lo.max(hi - MAX_DECADES);
    let y = |v: f64| {
        let l = if positive(v) { v.log10().clamp(f64::from(lo), f64::from(hi)) } else { f64::from(lo) };
        N(top + plot_h * (f64::from(hi) - l) / f64::from(hi - lo))
    };
    let mut s = String::new();
    let _ = write!(s, r#"<svg class="chart lossy" viewBox="0 0 {w} {h}" width="{w}" height="{h}" role="img">"#);
    let _ = write!(s, "<title>{}</title>", xml(&format!("KL(reference || path) over the corpus, {checkpoint}")));
    let bands = paths.iter().map(|(_, d)| d.by_position.len()).max().unwrap_or(0).max(1);
    for (panel, title) in [(0usize, "KL percentiles over every position"), (1, "mean KL by context position")] {
        let x0 = left + panel as f64 * (panel_w + gap);
        let (px0, px1, py0) = (N(x0), N(x0 + panel_w), N(top));
        let mut grid = String::new();
        for d in lo..=hi {
            let yy = y(10f64.powi(d));
            let _ = write!(grid, "M{px0} {yy}H{px1}");
            let _ = write!(s, r#"<text class="ty" x="{}" y="{}">1e{d}</text>"#, N(x0 - 4.0), N(yy.0 + 3.5));
        }
        let _ = write!(s, r#"<path class="grid" d="{grid}"/>"#);
        let _ =
            write!(s, r#"<text class="tx" x="{}" y="{}">{}</text>"#, N(x0 + panel_w / 2.0), N(top - 8.0), xml(title));
        let x = |k: f64, n: f64| N(x0 + if n <= 1.0 { panel_w / 2.0 } else { panel_w * k / (n - 1.0) });
        if panel == 0 {
            for q in [0usize, 50, 90, 99, 100] {
                let _ = write!(
                    s,
                    r#"<text class="tx" x="{}" y="{}">p{q}</text>"#,
                    x(q as f64, 101.0),
                    N(h - bottom + 12.0)
                );
            }
        } else if let Some((_, d)) = paths.iter().max_by_key(|(_, d)| d.by_position.len()) {
            for (k, b) in d.by_position.iter().enumerate() {
                let _ = write!(
                    s,
                    r#"<text class="tx" x="{}" y="{}">{}</text>"#,
                    x(k as f64, bands as f64),
                    N(h - bottom + 12.0),
                    b.from
                );
            }
            let _ = write!(s, r#"<text class="tx" x="{}" y="{}">position</text>"#, px1, N(h - 3.0));
        }
        for (i, (name, d)) in paths.iter().enumerate() {
            let color = PALETTE[i % PALETTE.len()];
            let points: Vec<(N, N, String)> = if panel == 0 {
                let n = d.kl_percentiles.len() as f64;
                d.kl_percentiles
                    .iter()
                    .enumerate()
                    .map(|(q, &v)| (x(q as f64, n), y(v), format!("{name}: p{q} KL {v:.3e}")))
                    .collect()
            } else {
                d.by_position
                    .iter()
                    .enumerate()
                    .map(|(k, b)| {
                        (
                            x(k as f64, bands as f64),
                            y(b.kl_mean),
                            format!(
                                "{name}: positions {}-{}: mean KL {:.3e} ({} positions)",
                                b.from, b.to, b.kl_mean, b.positions
                            ),
                        )
                    })
                    .collect()
            };
            let line: String = points
                .iter()
                .enumerate()
                .map(|(k, (px, py, _))| format!("{}{px} {py}", if k == 0 { "M" } else { "L" }))
                .collect();
            let _ = write!(s, r#"<path fill="none" stroke="{color}" stroke-width="1.5" d="{line}"/>"#);
            let every = if panel == 0 { 10 } else { 1 };
            for (px, py, tip) in points.iter().step_by(every) {
                let _ = write!(
                    s,
                    r#"<circle fill="{color}" cx="{px}" cy="{py}" r="2.5"><title>{}</title></circle>"#,
                    xml(tip)
                );
            }
            if panel == 0 {
                let _ = write!(
                    s,
                    r#"<text x="{}" y="{}" fill="{color}" font-size="11">{}</text>"#,
                    N(x0 + 6.0),
                    N(top + 12.0 + 13.0 * i as f64),
                    xml(name)
                );
            }
        }
        let _ = write!(s, r#"<rect class="frame" x="{px0}" y="{py0}" width="{}" height="{}"/>"#, N(panel_w), N(plot_h));
    }
    s.push_str("</svg>");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn places(steps: &[(usize, usize, usize)]) -> Vec<StepPlace> {
        let each = steps.iter().map(|&(kv_row, position, pads_trimmed)| StepPlace {
            step: 0,
            kv_row,
            position,
            pads_trimmed,
            rolled_back: 0,
        });
        StepPlace::expand(&StepPlace::runs(each), steps.len())
    }

    #[test]
    fn coordinates_are_short() {
        assert_eq!(N(40.0).to_string(), "40");
        assert_eq!(N(59.46).to_string(), "59.5");
        assert_eq!(N(-0.04).to_string(), "0");
    }

    #[test]
    fn guides_mark_boundaries_and_rewinds() {
        // Steps fed rows 15, 16, 17, then a rewind to 16.
        let steps = [(15, 15, 0), (16, 16, 0), (17, 17, 0), (16, 16, 0)];
        let layout = places(&steps);
        assert_eq!(StepPlace::runs(layout.clone()).len(), 2, "a run, then the rewind");
        assert_eq!(layout[2], StepPlace { step: 2, kv_row: 17, position: 17, pads_trimmed: 0, rolled_back: 0 });
        let g = guides(&layout, Some(8), 16);
        assert_eq!(g, [(1, Guide::Block), (1, Guide::Tile), (3, Guide::Trim), (3, Guide::Block), (3, Guide::Tile)]);
        // Dense path: no blocks; trimmed pads at step 0 count as a trim.
        let g = guides(&places(&[(47, 36, 11), (48, 37, 11)]), None, 16);
        assert_eq!(g, [(0, Guide::Trim)]);
        // A rollback leaves the fed rows contiguous; its count says where it happened.
        let mut layout = places(&[(5, 5, 0), (6, 6, 0), (7, 7, 0)]);
        layout[2].rolled_back = 3;
        assert_eq!(guides(&layout, None, 0), [(2, Guide::Trim)]);
    }
}
