//! What each case claims, and the evidence for it (see `vocab::evidence`). A stepped case's
//! claims come from what its scenario is for and what parity actually drove ([`Driven`]); the
//! evidence from the engine's replies and its own counters. The judge turns a contradicted
//! claim into a `vacuous` row and a violated memory claim into a failed one.

use crate::engine::PathInfo;
use crate::engine::openai::Metrics;
use crate::kv::{Counters, KvStats};
use crate::scenario::requests::{Answers, Sent};
use crate::scenario::{Driven, Observed};
use crate::vocab::{Evidence, MEMORY_CLAIMS, Scenario, Status, Witness};

/// How far a layout's measured bytes per row may sit from what it declares: rounding of a
/// quantized layout's per-group scales, never a dtype (the narrowest change, 8 to 16 bits, is
/// 100%).
const ROW_BYTES_SLACK: f64 = 0.01;

/// The claims of a stepped case of scenario `sc` (case name `case`), in the order shown.
fn claims(sc: Scenario, case: &str, d: &Driven, info: &PathInfo) -> Vec<&'static str> {
    let mut out = match sc {
        Scenario::Batch2 | Scenario::Concurrent | Scenario::Repeat => vec!["batched"],
        Scenario::Padded if case == "tile" => vec!["trimmed"],
        Scenario::Padded if case == "batch-right" => vec!["batched", "trimmed"],
        Scenario::Padded => vec!["batched"],
        Scenario::Chunked => vec!["chunked"],
        Scenario::Rollback => vec!["trimmed"],
        Scenario::Prefix if case.starts_with("while-running") => vec!["shared", "batched"],
        Scenario::Prefix => vec!["shared"],
        _ => Vec::new(),
    };
    if let Some(bs) = info.capabilities.block_size.filter(|&b| b > 0) {
        if d.longest > bs {
            out.push("crosses-blocks");
        }
        if d.interleaved {
            out.push("non-adjacent");
        }
    }
    if info.capabilities.stats {
        if info.capabilities.block_size.is_some() {
            out.push("blocks-held");
        }
        if info.capabilities.kv_row_bytes.is_some() {
            out.push("row-bytes");
        }
    }
    out
}

/// The evidence for every claim of a stepped case, the suite's witness rules applied.
pub(super) fn steps(
    sc: Scenario,
    case: &str,
    o: &Observed,
    kv: Option<&KvStats>,
    info: &PathInfo,
    w: &Witness,
) -> Vec<Evidence> {
    let c = o.counters.unwrap_or_default();
    let counted = o.counters.is_some();
    claims(sc, case, &o.driven, info)
        .into_iter()
        .map(|claim| {
            let (wanted, seen, status) = match claim {
                "batched" => batched(&o.driven, &c),
                "trimmed" => trimmed(&o.driven, &c),
                "shared" => shared(&o.driven, &c),
                "chunked" => chunked(&o.driven, &c),
                "crosses-blocks" => counter(
                    format!("reads that span blocks (a sequence of {} rows, blocks of {})", o.driven.longest, bs(info)),
                    c.reads_crossing_blocks,
                    "model calls whose read spanned blocks",
                ),
                "non-adjacent" => counter(
                    "a gather of blocks that are not adjacent (sequences took blocks in turn)".into(),
                    c.reads_non_adjacent,
                    "model calls that gathered non-adjacent blocks",
                ),
                "blocks-held" => blocks_held(kv, &o.live, bs(info)),
                "row-bytes" => row_bytes(kv, &o.live, info),
                other => (other.to_string(), "no rule".into(), Status::Unreported),
            };
            judged(Evidence { claim: claim.into(), wanted, seen, status }, w, counted)
        })
        .collect()
}

/// The evidence for every claim of a server's case: parity's own timing of the schedule, the
/// usage the server returned, and the counters the suite names.
pub(super) fn requests(sc: Scenario, case: &str, a: &Answers, w: &Witness) -> Vec<Evidence> {
    let mut out = Vec::new();
    let mut claim = |claim: &str, (wanted, seen, status): Found| {
        out.push(judged(Evidence { claim: claim.into(), wanted, seen, status }, w, false));
    };
    match sc {
        Scenario::Concurrent => claim("overlapped", overlapped(&a.timeline)),
        Scenario::Repeat if case == "cached" => claim("cached", cached(a)),
        Scenario::Prefix => claim("cached", cached(a)),
        Scenario::Corpus => claim("cached", extended(a)),
        _ => {}
    }
    for (name, moves) in w.moves.iter().map(|m| (m, true)).chain(w.still.iter().map(|m| (m, false))) {
        claim(&format!("metric:{name}"), metric(a.metrics.as_ref(), name, moves));
    }
    out
}

/// A server ran requests together if one was under way while another was: a streamed
/// request is under way from its first token to its last, any request at the moment it is
/// answered. A server that takes requests one at a time has one under way at any moment,
/// whatever order it takes them in.
fn overlapped(timeline: &[Option<Sent>]) -> Found {
    let wanted = "two requests under way at once".to_string();
    let done: Vec<(usize, f64, f64)> = timeline
        .iter()
        .enumerate()
        .filter_map(|(i, t)| t.map(|t| (i, t.first_token.unwrap_or(t.answered), t.answered)))
        .collect();
    if done.len() < 2 || !done.iter().any(|(_, from, to)| to > from) {
        return (wanted, "no streamed request and another were both answered".into(), Status::Unreported);
    }
    let both = done
        .iter()
        .flat_map(|a| done.iter().map(move |b| (a, b)))
        .find(|(a, b)| a.0 != b.0 && a.2 > a.1 && b.1 > a.1 && b.1 < a.2);
    match both {
        Some((a, b)) => (
            wanted,
            format!(
                "request {} was under way at {:.2}s, while request {} streamed ({:.2}s to {:.2}s)",
                b.0, b.1, a.0, a.1, a.2
            ),
            Status::Held,
        ),
        None => (
            wanted,
            format!(
                "no two of the {} answered requests were under way at once: the server answered them one at a time",
                done.len()
            ),
            Status::Missing,
        ),
    }
}

/// The measured request came (partly) from the server's prompt cache, by its own account.
fn cached(a: &Answers) -> Found {
    let wanted = "prompt tokens served from the server's prompt cache".to_string();
    let Some(c) = a.requests.first().and_then(|r| r.result.as_ref().ok()) else {
        return (wanted, "the request was not answered".into(), Status::Unreported);
    };
    let prompt = a.requests[0].request.ids.len();
    match c.cached_tokens {
        None => (
            wanted,
            "the server reports no cached tokens (usage.prompt_tokens_details, timings)".into(),
            Status::Unreported,
        ),
        Some(0) => {
            (wanted, format!("the server served none of the {prompt} prompt tokens from its cache"), Status::Missing)
        }
        Some(n) => (wanted, format!("{n} of {prompt} prompt tokens from the cache"), Status::Held),
    }
}

/// A corpus read through a server is the decode path only if each request after the first
/// was computed as one new token over the previous prompt, held in the prompt cache: every
/// such request must report all but its last token cached. A server that recomputed a prefix
/// read that position by prefill, another kernel over another rounding.
fn extended(a: &Answers) -> Found {
    let wanted = "each position one new token over the previous prompt, from the server's prompt cache".to_string();
    let later = || a.requests.iter().skip(1).filter_map(|r| Some((r.request.ids.len(), r.result.as_ref().ok()?)));
    let total = later().count();
    if total == 0 {
        return (wanted, "no request after the first was answered".into(), Status::Unreported);
    }
    if later().all(|(_, c)| c.cached_tokens.is_none()) {
        let seen = "the server reports no cached tokens (usage.prompt_tokens_details, timings)".into();
        return (wanted, seen, Status::Unreported);
    }
    let short: Vec<(usize, Option<usize>)> = later()
        .filter(|(n, c)| c.cached_tokens.is_none_or(|k| k + 1 < *n))
        .map(|(n, c)| (n, c.cached_tokens))
        .collect();
    match short.first() {
        None => (
            wanted,
            format!(
                "{total} of {total} requests after the first served all but at most their last token from the cache"
            ),
            Status::Held,
        ),
        Some(&(n, cached)) => (
            wanted,
            format!(
                "{} of {total} requests were not (first: {} of a {n}-token prompt from the cache)",
                short.len(),
                cached.map_or("none reported".to_string(), |c| c.to_string())
            ),
            Status::Missing,
        ),
    }
}

/// A Prometheus counter that must move (or stay) during the case.
fn metric(m: Option<&Result<(Metrics, Metrics), String>>, name: &str, moves: bool) -> Found {
    let wanted = if moves { format!("`{name}` increases") } else { format!("`{name}` does not change") };
    let (before, after) = match m {
        None => return (wanted, "no counters were read".into(), Status::Unreported),
        Some(Err(e)) => return (wanted, format!("the counters could not be read: {e}"), Status::Missing),
        Some(Ok(pair)) => pair,
    };
    let (Some(&a), Some(&b)) = (before.get(name), after.get(name)) else {
        return (wanted, format!("the metrics endpoint has no `{name}`"), Status::Missing);
    };
    let seen = format!("{a} -> {b}");
    let held = if moves { b > a } else { b == a };
    (wanted, seen, if held { Status::Held } else { Status::Missing })
}

/// A claim with the suite's witness rules applied: waived, or required evidence that is not
/// reported counted as missing.
pub(super) fn judged(mut e: Evidence, w: &Witness, counted: bool) -> Evidence {
    let key = if e.claim.starts_with("metric:") { "metrics" } else { e.claim.as_str() };
    if let Some(why) = w.waive.get(key) {
        e.seen = format!("waived by the suite: {why} (seen: {})", e.seen);
        e.status = Status::Waived;
        return e;
    }
    let memory = MEMORY_CLAIMS.contains(&e.claim.as_str());
    let required = |r: &str| w.require.iter().any(|x| x == r);
    if e.status == Status::Unreported {
        let need = if memory {
            required("stats")
        } else if e.claim == "cached" {
            required("cached-tokens")
        } else if e.claim == "overlapped" || key == "metrics" {
            false
        } else {
            required("counters") && !counted
        };
        if need {
            e.seen = format!("{}; the suite requires this evidence", e.seen);
            e.status = Status::Missing;
        }
    }
    e
}

fn bs(info: &PathInfo) -> usize {
    info.capabilities.block_size.unwrap_or(0)
}

type Found = (String, String, Status);

fn batched(d: &Driven, c: &Counters) -> Found {
    let wanted = format!("{} sequences in one model call", d.max_rows.max(2));
    if d.max_rows < 2 {
        return (wanted, format!("parity sent no forward of two rows ({} forwards)", d.forwards), Status::Missing);
    }
    match c.max_rows {
        None => (wanted, "the path does not count rows per model call".into(), Status::Unreported),
        Some(m) if m >= 2 => (wanted, format!("up to {m} rows in one model call"), Status::Held),
        Some(m) => (
            wanted,
            format!(
                "{} forwards of up to {} rows ran as {} model calls of at most {m} row: one row at a time",
                d.forwards,
                d.max_rows,
                c.forwards.map_or("?".to_string(), |f| f.to_string())
            ),
            Status::Missing,
        ),
    }
}

fn trimmed(d: &Driven, c: &Counters) -> Found {
    let wanted = format!("{} rows trimmed away", d.rows_trimmed);
    if d.rows_trimmed == 0 {
        return ("rows trimmed away".into(), "nothing was trimmed".into(), Status::Missing);
    }
    let replies = format!("the replies removed {} rows and the lengths agree", d.rows_trimmed);
    match c.rows_trimmed {
        Some(n) if n < d.rows_trimmed => (wanted, format!("{replies}, but the engine counted {n}"), Status::Missing),
        Some(n) => (wanted, format!("{replies}; counted {n}"), Status::Held),
        None => (wanted, replies, Status::Held),
    }
}

fn shared(d: &Driven, c: &Counters) -> Found {
    let asked = d.rows_shared + d.rows_copied + d.rows_refused;
    let wanted = format!("{asked} prefix rows reused (shared or copied), not recomputed");
    if d.rows_refused > 0 {
        let seen =
            format!("the path answered share_prefix with no sequence: parity recomputed {} rows", d.rows_refused);
        return (wanted, seen, Status::Missing);
    }
    if asked == 0 {
        return ("prefix rows reused".into(), "no share was asked".into(), Status::Missing);
    }
    let how = match (d.rows_shared, d.rows_copied) {
        (s, 0) => format!("{s} rows shared"),
        (0, k) => format!("{k} rows copied"),
        (s, k) => format!("{s} rows shared, {k} copied"),
    };
    if let Some(t) = c.tokens.filter(|&t| t > d.tokens) {
        let seen = format!(
            "the engine said {how}, yet it computed {t} token positions for the {} parity fed: {} rows recomputed",
            d.tokens,
            t - d.tokens
        );
        return (wanted, seen, Status::Missing);
    }
    match (c.rows_shared, c.rows_copied) {
        (None, None) => (wanted, format!("the replies: {how}"), Status::Held),
        (s, k) => {
            let reused = s.unwrap_or(0) + k.unwrap_or(0);
            if reused < d.rows_shared + d.rows_copied {
                (wanted, format!("the replies: {how}; the engine counted {reused} rows reused"), Status::Missing)
            } else {
                let tokens =
                    c.tokens.map_or(String::new(), |t| format!(", {t} token positions computed for {} fed", d.tokens));
                (wanted, format!("{how}; counted {reused} reused{tokens}"), Status::Held)
            }
        }
    }
}

fn chunked(d: &Driven, c: &Counters) -> Found {
    let wanted = "the prompt prefilled in chunks, each its own model call".to_string();
    match c.forwards {
        Some(f) if f < d.forwards => (
            wanted,
            format!("{} forwards sent ran as {f} model calls: chunks were merged", d.forwards),
            Status::Missing,
        ),
        Some(f) => (wanted, format!("{} forwards sent, {f} model calls", d.forwards), Status::Held),
        None => {
            (wanted, format!("{} forwards sent, each answered with its logits and lengths", d.forwards), Status::Held)
        }
    }
}

fn counter(wanted: String, value: Option<u64>, what: &str) -> Found {
    match value {
        None => (wanted, format!("the path does not count {what}"), Status::Unreported),
        Some(0) => (wanted, format!("no {what}"), Status::Missing),
        Some(n) => (wanted, format!("{n} {what}"), Status::Held),
    }
}

fn blocks_held(kv: Option<&KvStats>, live: &[usize], bs: usize) -> Found {
    let need: usize = live.iter().map(|&l| l.div_ceil(bs.max(1))).sum();
    let wanted = format!("at most {need} blocks of {bs} for the live lengths {live:?}");
    match kv {
        None => (wanted, "no KV statistics".into(), Status::Unreported),
        // Blocks of a window's layers count as the fraction of a block of every layer they
        // store: what the live sequences need is a bound on every group at once.
        Some(s) if s.full_blocks_in_use().is_some() => {
            let held = s.full_blocks_in_use().unwrap_or(0.0);
            let seen = format!(
                "{held:.2} blocks of every layer held ({} blocks of layer groups, peak {})",
                s.blocks_in_use, s.peak_blocks_in_use
            );
            if held > need as f64 + 1e-9 {
                (wanted, format!("{seen}: more than the live sequences need"), Status::Missing)
            } else {
                (wanted, seen, Status::Held)
            }
        }
        Some(s) if s.blocks_in_use > need => (
            wanted,
            format!(
                "{} blocks held (peak {}): {} more than the live sequences need",
                s.blocks_in_use,
                s.peak_blocks_in_use,
                s.blocks_in_use - need
            ),
            Status::Missing,
        ),
        Some(s) => (wanted, format!("{} blocks held (peak {})", s.blocks_in_use, s.peak_blocks_in_use), Status::Held),
    }
}

fn row_bytes(kv: Option<&KvStats>, live: &[usize], info: &PathInfo) -> Found {
    let declared = info.capabilities.kv_row_bytes.unwrap_or(0);
    let wanted = format!("{declared} bytes of K and V per row, as the layout declares");
    let Some(s) = kv else { return (wanted, "no KV statistics".into(), Status::Unreported) };
    let rows: usize = live.iter().sum();
    // Live bytes over live rows, and for a pool its blocks' bytes over their rows: either is
    // what one row really costs.
    let mut measured = Vec::new();
    if s.layers > 0 {
        // A pool whose window layers keep fewer rows than its global ones: bytes over rows
        // counted once per layer that stores them, times the layers, is a row of every layer.
        let per_row = |bytes: u64, layer_rows: u64| bytes as f64 * s.layers as f64 / layer_rows as f64;
        let bs = info.capabilities.block_size.unwrap_or(1) as u64;
        if s.layer_rows_live > 0 && s.bytes_live > 0 {
            measured.push(("live", per_row(s.bytes_live, s.layer_rows_live)));
        }
        if s.layer_blocks_in_use > 0 {
            measured.push(("in blocks", per_row(s.bytes_in_use, s.layer_blocks_in_use * bs)));
        } else if s.peak_layer_blocks > 0 {
            measured.push(("at peak", per_row(s.peak_bytes_in_use, s.peak_layer_blocks * bs)));
        }
    } else {
        if rows > 0 && s.bytes_live > 0 {
            measured.push(("live", s.bytes_live as f64 / rows as f64));
        }
        if let Some(bs) = info.capabilities.block_size {
            if s.blocks_in_use > 0 {
                measured.push(("in blocks", s.bytes_in_use as f64 / (s.blocks_in_use * bs) as f64));
            } else if s.peak_blocks_in_use > 0 {
                // Everything released: the pool at its peak says what a row cost.
                measured.push(("at peak", s.peak_bytes_in_use as f64 / (s.peak_blocks_in_use * bs) as f64));
            }
        }
    }
    if measured.is_empty() {
        return (wanted, "nothing held when the case ended".into(), Status::Unreported);
    }
    let off = measured.iter().find(|(_, m)| (m - declared as f64).abs() > ROW_BYTES_SLACK * declared as f64);
    let list: Vec<String> = measured.iter().map(|(how, m)| format!("{m:.0} ({how})")).collect();
    match off {
        Some((_, m)) => (
            wanted,
            format!("stores {} bytes per row: {:.2}x what it declares", list.join(", "), m / declared as f64),
            Status::Missing,
        ),
        None => (wanted, format!("{} bytes per row", list.join(", ")), Status::Held),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Capabilities;
    use crate::vocab::EngineId;

    fn info(block_size: Option<usize>) -> PathInfo {
        PathInfo {
            name: "p".into(),
            engine: EngineId::builtin("cpu".into()),
            vocab_size: 10,
            dtype: crate::dtype::DtypeName::Float32,
            capabilities: Capabilities {
                masked_prefix: true,
                share_prefix: true,
                max_batch: None,
                stats: true,
                block_size,
                kv_row_bytes: Some(64),
                faults: Vec::new(),
            },
        }
    }

    fn status(e: &[Evidence], claim: &str) -> Status {
        e.iter().find(|e| e.claim == claim).map(|e| e.status).unwrap_or_else(|| panic!("no `{claim}` in {e:?}"))
    }

    /// A "batched" forward the engine ran one row at a time (its counters say so) is the
    /// vacuous pass this module exists for.
    #[test]
    fn a_two_row_forward_run_row_by_row_is_missing_its_batching() {
        let o = Observed {
            driven: Driven { forwards: 10, max_rows: 2, tokens: 30, ..Driven::default() },
            counters: Some(Counters { forwards: Some(20), max_rows: Some(1), tokens: Some(30), ..Counters::default() }),
            live: vec![],
        };
        let e = steps(Scenario::Batch2, "same", &o, None, &info(None), &Witness::default());
        assert_eq!(status(&e, "batched"), Status::Missing);
        assert!(e[0].seen.contains("one row at a time"), "{e:?}");
        // Without counters the claim is unreported, and missing only where the suite requires counters.
        let o = Observed { counters: None, ..o };
        let e = steps(Scenario::Batch2, "same", &o, None, &info(None), &Witness::default());
        assert_eq!(status(&e, "batched"), Status::Unreported);
        let w = Witness { require: vec!["counters".into()], ..Witness::default() };
        assert_eq!(status(&steps(Scenario::Batch2, "same", &o, None, &info(None), &w), "batched"), Status::Missing);
        let w = Witness { waive: [("batched".into(), "runs rows one by one".into())].into(), ..Witness::default() };
        assert_eq!(status(&steps(Scenario::Batch2, "same", &o, None, &info(None), &w), "batched"), Status::Waived);
    }

    /// A share the engine says it made, while it computed more tokens than parity fed: the
    /// prefix was recomputed behind a "copy" reply.
    #[test]
    fn a_share_answered_by_recomputing_is_missing() {
        let driven = Driven { forwards: 3, max_rows: 1, tokens: 12, rows_copied: 6, ..Driven::default() };
        let honest = Counters { tokens: Some(12), rows_copied: Some(6), ..Counters::default() };
        let o = Observed { driven: driven.clone(), counters: Some(honest), live: vec![] };
        assert_eq!(
            status(&steps(Scenario::Prefix, "after-finish", &o, None, &info(None), &Witness::default()), "shared"),
            Status::Held
        );
        let lying = Counters { tokens: Some(18), ..honest };
        let o = Observed { counters: Some(lying), ..o };
        let e = steps(Scenario::Prefix, "after-finish", &o, None, &info(None), &Witness::default());
        assert_eq!(status(&e, "shared"), Status::Missing);
        assert!(e[0].seen.contains("6 rows recomputed"), "{e:?}");
        let refused =
            Observed { driven: Driven { rows_refused: 6, rows_copied: 0, ..driven }, counters: None, live: vec![] };
        let e = steps(Scenario::Prefix, "after-finish", &refused, None, &info(None), &Witness::default());
        assert!(e[0].seen.contains("parity recomputed 6 rows"), "{e:?}");
    }

    /// Memory: a pool holding more blocks than its live sequences need, and a layout stored at
    /// twice the bytes it declares, are both violations with the numbers.
    #[test]
    fn memory_claims_hold_blocks_and_bytes_to_the_live_rows() {
        let o = Observed { driven: Driven::default(), counters: None, live: vec![9, 3] };
        let fine = KvStats { bytes_live: 12 * 64, bytes_in_use: 3 * 8 * 64, blocks_in_use: 3, ..KvStats::default() };
        let e = steps(Scenario::Single, "plain", &o, Some(&fine), &info(Some(8)), &Witness::default());
        assert_eq!((status(&e, "blocks-held"), status(&e, "row-bytes")), (Status::Held, Status::Held));
        let hoard = KvStats { blocks_in_use: 5, bytes_in_use: 5 * 8 * 64, ..fine };
        let e = steps(Scenario::Single, "plain", &o, Some(&hoard), &info(Some(8)), &Witness::default());
        assert_eq!(status(&e, "blocks-held"), Status::Missing);
        assert!(e[0].seen.contains("5 blocks held") && e[0].seen.contains("2 more"), "{e:?}");
        let wide = KvStats { bytes_live: 2 * 12 * 64, bytes_in_use: 2 * 3 * 8 * 64, ..fine };
        let e = steps(Scenario::Single, "plain", &o, Some(&wide), &info(Some(8)), &Witness::default());
        let bytes = e.iter().find(|e| e.claim == "row-bytes").expect("row-bytes");
        assert_eq!(bytes.status, Status::Missing);
        assert!(bytes.seen.contains("2.00x"), "{bytes:?}");
    }

    /// Paged reads: the claims exist only where the case made them (a sequence longer than a
    /// block; sequences taking blocks in turn), and a pool that never gathered fails them.
    #[test]
    fn block_claims_follow_what_the_case_drove() {
        let short = Observed { driven: Driven { longest: 8, ..Driven::default() }, counters: None, live: vec![] };
        let e = steps(Scenario::Single, "plain", &short, None, &info(Some(8)), &Witness::default());
        assert!(!e.iter().any(|e| e.claim == "crosses-blocks" || e.claim == "non-adjacent"), "{e:?}");
        let long = Observed {
            driven: Driven { longest: 9, interleaved: true, ..Driven::default() },
            counters: Some(Counters {
                reads_crossing_blocks: Some(4),
                reads_non_adjacent: Some(0),
                ..Counters::default()
            }),
            live: vec![],
        };
        let e = steps(Scenario::Batch2, "same", &long, None, &info(Some(8)), &Witness::default());
        assert_eq!((status(&e, "crosses-blocks"), status(&e, "non-adjacent")), (Status::Held, Status::Missing));
    }
}
