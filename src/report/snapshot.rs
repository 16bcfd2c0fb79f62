//! Snapshot reports in insta's `.snap` format, one file per checkpoint and scenario under
//! `reports/<suite>/`: token ids, verdicts, divergence locations and metrics bucketed (within
//! tolerance, or the decade past it), so the file is byte-identical across runs of the same
//! code, on any machine of the same device kind, and a reviewer sees a change only when
//! behaviour changed.
//!
//! A run writes `<name>.snap.new` next to a differing accepted `<name>.snap`, as insta does, so
//! `parity review` / `parity accept` and `cargo insta review` both work on them. GPU runs keep
//! their own snapshots under `reports/<suite>/gpu/` (Metal arithmetic differs from the CPU's).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use super::{CheckpointStatus, Report, Row};

/// What a run does with a snapshot that differs from the accepted one (`--update`, or the
/// `PARITY_UPDATE` / `INSTA_UPDATE` environment variables, insta's names and meanings).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpdateMode {
    /// Write `.snap.new` for review (default).
    New,
    /// Overwrite the accepted `.snap` (accept everything).
    Always,
    /// Write new snapshots as accepted, changed ones as `.snap.new`.
    Unseen,
    /// Write nothing; a change still fails the run.
    No,
}

impl std::str::FromStr for UpdateMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "new" | "auto" => Ok(UpdateMode::New),
            // insta's `force` rewrites even unchanged snapshots; parity writes every
            // snapshot of a run anyway, so it is `always`.
            "always" | "overwrite" | "force" => Ok(UpdateMode::Always),
            "unseen" => Ok(UpdateMode::Unseen),
            "no" => Ok(UpdateMode::No),
            other => Err(format!("unknown update mode `{other}`; expected new, always (or force), unseen or no")),
        }
    }
}

impl UpdateMode {
    /// From `PARITY_UPDATE`, else `INSTA_UPDATE`, else `new`.
    /// A bad value is an error naming the variable it came from.
    pub fn from_env() -> Result<Self, String> {
        for var in ["PARITY_UPDATE", "INSTA_UPDATE"] {
            match std::env::var(var) {
                Ok(v) if !v.is_empty() => return v.parse().map_err(|e| format!("{var}: {e}")),
                _ => {}
            }
        }
        Ok(UpdateMode::New)
    }
}

/// The snapshot directory of a suite on this run's device. The suite name and the device
/// become path components, so each must be a plain file name (the suite parser already
/// rejects others; this holds for reports built any other way too, e.g. merged JSON).
pub fn dir(reports: &Path, report: &Report) -> std::io::Result<PathBuf> {
    let component = |what: &str, name: &str| {
        crate::names::check_component(name).map_err(|why| outside(format!("{what} `{name}` {why}")))
    };
    component("suite name", &report.suite)?;
    let base = reports.join(&report.suite);
    let env = &report.environment;
    if env.device == "cpu" {
        return Ok(base);
    }
    // CUDA's arithmetic is neither Metal's nor the CPU's: its snapshots get a folder of their
    // own. Metal keeps `gpu/` (its snapshots were accepted there before backends were named).
    let folder = match env.backend.as_deref() {
        Some("cuda") => "cuda",
        _ => env.device.as_str(),
    };
    component("device", folder)?;
    Ok(base.join(folder))
}

fn outside(message: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("refusing to write a snapshot: {message}"))
}

/// File stem and content of every snapshot this report yields: one per (checkpoint, scenario)
/// of each checkpoint that ran and is snapshotted (not `no_snapshot`).
pub fn render(report: &Report) -> BTreeMap<String, String> {
    let snapshotted =
        || report.checkpoints.iter().filter(|c| c.status == CheckpointStatus::Ran && c.no_snapshot.is_none());
    let mut groups: BTreeMap<(String, String), Vec<&Row>> = BTreeMap::new();
    for c in snapshotted() {
        for r in report.rows.iter().filter(|r| r.checkpoint == c.name) {
            groups.entry((c.name.clone(), r.scenario.clone())).or_default().push(r);
        }
    }
    let mut out = BTreeMap::new();
    for ((checkpoint, scenario), rows) in groups {
        let Some(c) = report.checkpoints.iter().find(|c| c.name == checkpoint) else {
            continue;
        };
        let mut s = String::new();
        let _ = writeln!(s, "---");
        let _ = writeln!(s, "source: {}", yaml_str(&report.suite_file));
        let _ = writeln!(s, "expression: {}", yaml_str(&format!("{checkpoint} / {scenario}")));
        let _ = writeln!(s, "---");
        let _ = writeln!(s, "checkpoint: {}", yaml_str(&checkpoint));
        let _ = writeln!(s, "scenario: {scenario}");
        let _ = writeln!(s, "dtype: {}", c.dtype);
        if c.dequantized {
            let _ = writeln!(s, "dequantized: true");
        }
        // Builtin runs keep the header they always had; other engines say who served the
        // paths and where the reference came from (names only: a version bump is not a change
        // of behaviour to review).
        if let Some(e) = c.engine.as_ref().filter(|e| e.kind != "builtin") {
            let _ = writeln!(s, "engine: {} ({})", yaml_str(&e.name), e.kind);
            if let (Some(re), Some(rp)) = (&c.reference_engine, &c.reference_path) {
                let _ = writeln!(s, "reference: {}", yaml_str(&format!("{} {} ({})", re.name, rp, re.kind)));
            }
        } else if let (Some(re), Some(rp)) =
            (c.reference_engine.as_ref().filter(|e| e.kind != "builtin"), &c.reference_path)
        {
            // A builtin run against a reference in a child (`builtin:dense@cpu`) compares with
            // something else than the in-process reference its accepted rows were made against.
            let _ = writeln!(s, "reference: {}", yaml_str(&format!("{} {} ({})", re.name, rp, re.kind)));
        }
        let st = &c.settings;
        let _ = writeln!(
            s,
            "settings: {{max_tokens: {}, block_size: {}, tile: {}, chunk: {}, lookahead: {}, poison: {}}}",
            st.max_tokens, st.block_size, st.tile, st.chunk, st.lookahead, st.poison
        );
        let _ = writeln!(s, "rows:");
        for r in rows {
            row(&mut s, r, c);
        }
        out.insert(file_stem(&checkpoint, &scenario), s);
    }
    for c in snapshotted().filter(|c| !c.prompt_ids.is_empty()) {
        if report.rows.iter().any(|r| r.checkpoint == c.name) {
            out.insert(file_stem(&c.name, PROMPTS), prompts(report, c));
        }
    }
    out
}

/// The stem suffix of a checkpoint's prompts snapshot (no scenario has this name).
pub const PROMPTS: &str = "prompts";

/// What each prompt was as token ids for this checkpoint: when a row's tokens change, the
/// review shows beside it whether the input changed (a prompt, chat template or tokenizer
/// edit) or the engine did.
fn prompts(report: &Report, c: &super::CheckpointReport) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "---");
    let _ = writeln!(s, "source: {}", yaml_str(&report.suite_file));
    let _ = writeln!(s, "expression: {}", yaml_str(&format!("{} / {PROMPTS}", c.name)));
    let _ = writeln!(s, "---");
    let _ = writeln!(s, "checkpoint: {}", yaml_str(&c.name));
    let _ = writeln!(s, "prompts:");
    for (name, ids) in &c.prompt_ids {
        let _ = writeln!(s, "  - name: {}", yaml_str(name));
        let _ = writeln!(s, "    tokens: {}", ids.len());
        let _ = writeln!(s, "    ids: {}", self::ids(ids));
    }
    s
}

/// The id of the row that line `at` (0-based) of a rendered snapshot belongs to, as every
/// report prints it (`checkpoint/prompt/scenario:case/path`), so a review hunk whose context
/// does not reach the row's first lines still says which row changed and can be copied into
/// `--filter`. `None` for header lines.
pub fn row_of_line(text: &str, at: usize) -> Option<String> {
    let lines: Vec<&str> = text.lines().collect();
    let value = |line: &str, key: &str| {
        line.trim_start().strip_prefix(key).map(|v| {
            let v = v.trim();
            v.strip_prefix('"').and_then(|v| v.strip_suffix('"')).unwrap_or(v).to_string()
        })
    };
    let header = |key: &str| lines.iter().find_map(|l| value(l, key).filter(|_| l.starts_with(key)));
    let (checkpoint, scenario) = (header("checkpoint:")?, header("scenario:")?);
    let start = (0..=at.min(lines.len().checked_sub(1)?)).rev().find(|&i| lines[i].starts_with("  - prompt:"))?;
    let prompt = value(lines[start], "- prompt:")?;
    let body: Vec<&str> = lines[start + 1..].iter().take_while(|l| !l.starts_with("  - ")).copied().collect();
    let find = |key: &str| body.iter().find_map(|l| value(l, key));
    Some(super::row_id(&checkpoint, &prompt, &scenario, &find("case:")?, &find("backend:")?))
}

fn row(s: &mut String, r: &Row, c: &super::CheckpointReport) {
    let tolerance = c.max_rel_rms_tolerance;
    let _ = writeln!(s, "  - prompt: {}", yaml_str(&r.prompt));
    let _ = writeln!(s, "    case: {}", yaml_str(&r.case));
    let _ = writeln!(s, "    backend: {}", r.path);
    let _ = writeln!(s, "    verdict: {}", r.verdict.name());
    let _ = writeln!(s, "    pass: {}", r.pass);
    if r.nan {
        let _ = writeln!(s, "    max_rel_rms: nan");
    } else if let Some(x) = r.max_rel_rms {
        let _ = writeln!(s, "    max_rel_rms: {}", bucket(x, tolerance));
    }
    if let (Some(api), Some(tol)) = (&r.api, c.max_logprob_delta_tolerance)
        && r.verdict != crate::vocab::Verdict::Error
    {
        let _ = writeln!(s, "    max_logprob_delta: {}", bucket(api.max_logprob_delta as f32, tol));
    }
    if let Some(d) = &r.first_divergence {
        let mut loc = format!(
            "step: {}, position: {}, position_mod_tile: {}, kv_row: {}",
            d.choice.step, d.position, d.position_mod_tile, d.kv_row
        );
        if let (Some(b), Some(o)) = (d.block_index, d.offset_in_block) {
            let _ = write!(loc, ", block: {b}, offset: {o}");
        }
        let _ =
            write!(loc, ", pads_trimmed: {}, batch_row: {}, batch_size: {}", d.pads_trimmed, d.batch_row, d.batch_size);
        let _ = writeln!(s, "    divergence: {{{loc}}}");
        let _ = writeln!(s, "    reference_token: {}", d.choice.reference_token);
        let _ = writeln!(s, "    token: {}", d.choice.token);
    }
    // A lossy row's numbers move with every BLAS; whether each bound held is what a reviewer
    // accepts.
    if !r.bounds.is_empty() {
        let b: Vec<String> =
            r.bounds.iter().map(|b| format!("{}: {}", b.name, if b.held { "held" } else { "broken" })).collect();
        let _ = writeln!(s, "    bounds: {{{}}}", b.join(", "));
    }
    let _ = writeln!(s, "    tokens: {}", ids(&r.tokens));
    if r.tokens != r.reference_tokens {
        let _ = writeln!(s, "    reference_tokens: {}", ids(&r.reference_tokens));
    }
    if let Some(f) = &r.failure {
        let _ = writeln!(s, "    failure: {}", yaml_str(&strip_numbers_after_rms(f)));
    }
    for n in &r.notes {
        let _ = writeln!(s, "    note: {}", yaml_str(n));
    }
}

/// The failure text embeds a full-precision RMS; keep the sentence but not the digits, which
/// the bucket already reports.
fn strip_numbers_after_rms(f: &str) -> String {
    f.split("; ")
        .map(|part| {
            if part.starts_with("max relative RMS") {
                "max relative RMS over tolerance"
            } else if part.starts_with("max |delta logprob|") {
                "max |delta logprob| over tolerance"
            } else if part.starts_with("not bitwise identical") {
                "not bitwise identical"
            } else if part.starts_with("distribution: ") {
                "distribution outside its bounds"
            } else {
                part
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// `within tolerance` (float noise, including none at all), or, past the tolerance, the decade
/// (`"> tol, < 1e-1"`). Only the last can sit on a boundary, and such a row fails anyway.
///
/// Bit-identical (0) is deliberately not a bucket of its own: whether batched and single
/// decode agree to the last bit depends on which GEMM kernel the BLAS or GPU picks for each
/// shape (OpenBLAS vs Accelerate, M1 vs M3), not on the engine. With it, an engineer's Mac and
/// the CI runner would disagree on snapshots of correct code. The JSON keeps the exact value.
pub fn bucket(x: f32, tolerance: f32) -> String {
    if !x.is_finite() {
        return "nan".into();
    }
    if x <= tolerance {
        return "within tolerance".into();
    }
    let exp = x.log10().floor() as i32 + 1;
    format!("\"> tolerance, < 1e{exp}\"")
}

fn ids(v: &[u32]) -> String {
    let items: Vec<String> = v.iter().map(u32::to_string).collect();
    format!("[{}]", items.join(", "))
}

/// A YAML scalar that is always valid: plain when safe, double-quoted JSON-style otherwise.
fn yaml_str(s: &str) -> String {
    let plain = !s.is_empty()
        && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_./ ".contains(c))
        && !s.starts_with(['-', ' ', '.'])
        && !s.ends_with(' ')
        && !matches!(s, "true" | "false" | "null" | "yes" | "no" | "on" | "off")
        && s.parse::<f64>().is_err();
    if plain { s.to_string() } else { serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into()) }
}

pub fn file_stem(checkpoint: &str, scenario: &str) -> String {
    let clean = |s: &str| {
        s.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect::<String>()
    };
    format!("{}__{}", clean(checkpoint), clean(scenario))
}

/// A pending snapshot is new (nothing accepted yet) or changed (differs from the accepted
/// one). `run`, its reports and `review` all name it with [`Change::label`], so a reviewer sees
/// one word for one thing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    New,
    Changed,
}

impl Change {
    pub fn label(self) -> &'static str {
        match self {
            Change::New => "new snapshot",
            Change::Changed => "changed snapshot",
        }
    }

    /// The kind of a pending change as a report records it (see `Summary::snapshot_new`).
    pub fn of(name: &str, new: &[String]) -> Change {
        if new.iter().any(|n| n == name) { Change::New } else { Change::Changed }
    }
}

/// What `check` found and did.
#[derive(Debug, Default)]
pub struct Checked {
    /// Accepted snapshots the run differs from (or that do not exist yet), left pending.
    pub changes: Vec<PathBuf>,
    /// Those of `changes` that have no accepted snapshot yet.
    pub new: Vec<PathBuf>,
    /// Snapshots this run wrote as accepted (`always`, or `unseen` for new ones), so that an
    /// update run says what it changed instead of reporting "0 snapshot changes".
    pub accepted: Vec<PathBuf>,
}

/// Compare rendered snapshots with the accepted ones in `dir`, writing per `mode`.
///
/// Defence in depth against path traversal: nothing is read or written unless `dir` and every
/// file in it resolve inside `root` (the reports folder), whatever names the report carries.
/// The suite parser rejects unsafe names first; this guard holds for any caller.
pub fn check(
    root: &Path,
    dir: &Path,
    rendered: &BTreeMap<String, String>,
    mode: UpdateMode,
) -> std::io::Result<Checked> {
    if !crate::names::contained(root, dir) {
        return Err(outside(format!("{} is outside the reports folder {}", dir.display(), root.display())));
    }
    let mut out = Checked::default();
    for (stem, content) in rendered {
        crate::names::check_component(stem).map_err(|why| outside(format!("file name `{stem}` {why}")))?;
        let accepted = dir.join(format!("{stem}.snap"));
        let pending = dir.join(format!("{stem}.snap.new"));
        // Checked again after the stem: a symlinked file could still point out of the root.
        for p in [&accepted, &pending] {
            if !crate::names::contained(root, p) {
                return Err(outside(format!("{} resolves outside {}", p.display(), root.display())));
            }
        }
        let old = std::fs::read_to_string(&accepted).ok();
        if old.as_deref() == Some(content.as_str()) {
            if pending.exists() {
                std::fs::remove_file(&pending)?;
            }
            continue;
        }
        let write_accepted = match mode {
            UpdateMode::Always => true,
            UpdateMode::Unseen => old.is_none(),
            UpdateMode::New | UpdateMode::No => false,
        };
        std::fs::create_dir_all(dir)?;
        if write_accepted {
            std::fs::write(&accepted, content)?;
            if pending.exists() {
                std::fs::remove_file(&pending)?;
            }
            out.accepted.push(accepted);
            continue;
        }
        if mode != UpdateMode::No {
            std::fs::write(&pending, content)?;
        }
        if old.is_none() {
            out.new.push(accepted.clone());
        }
        out.changes.push(accepted);
    }
    Ok(out)
}

/// Pending snapshots (`*.snap.new`) under `dir`, recursively, sorted.
pub fn pending(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.to_string_lossy().ends_with(".snap.new") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// The accepted path a pending snapshot would replace.
pub fn accepted_path(pending: &Path) -> PathBuf {
    let s = pending.to_string_lossy();
    PathBuf::from(s.strip_suffix(".new").unwrap_or(&s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_deep_in_a_row_names_that_row() {
        let text = "---\nsource: s.toml\n---\ncheckpoint: tiny\nscenario: batch2\nrows:\n  - prompt: a\n    case: same\n    backend: dense\n    tokens: [1]\n  - prompt: \"b+1\"\n    case: ragged\n    backend: paged\n    verdict: identical\n    tokens: [2, 3]\n";
        assert_eq!(row_of_line(text, 9).as_deref(), Some("tiny/a/batch2:same/dense"));
        assert_eq!(row_of_line(text, 14).as_deref(), Some("tiny/b+1/batch2:ragged/paged"));
        assert_eq!(row_of_line(text, 3), None, "a header line belongs to no row");
    }

    #[test]
    fn buckets_separate_noise_from_failures() {
        assert_eq!(bucket(0.0, 1e-3), "within tolerance");
        assert_eq!(bucket(3.2e-7, 1e-3), "within tolerance");
        assert_eq!(bucket(1.0e-3, 1e-3), "within tolerance");
        assert_eq!(bucket(1.5e-2, 1e-3), "\"> tolerance, < 1e-1\"");
        assert_eq!(bucket(f32::NAN, 1e-3), "nan");
    }

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("parity-snapshot-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("scratch");
        d
    }

    fn one(stem: &str) -> BTreeMap<String, String> {
        BTreeMap::from([(stem.to_string(), "content\n".to_string())])
    }

    /// Defence in depth for issue #14 (a suite named `../../../x` wrote three folders above
    /// reports/): whatever a report's names are, the writer stays inside its root.
    #[test]
    fn the_writer_refuses_every_path_outside_its_root() {
        let base = scratch("escape");
        let root = base.join("reports");
        let refused = |dir: &Path, stem: &str| {
            let e = check(&root, dir, &one(stem), UpdateMode::New).expect_err("must refuse");
            assert!(e.to_string().contains("refusing to write a snapshot"), "{e}");
        };
        refused(&root.join("../../../x"), "a__single");
        refused(&base.join("elsewhere"), "a__single");
        refused(Path::new("/tmp"), "a__single");
        refused(&root.join("fixtures"), "../../x__single");
        refused(&root.join("fixtures"), "..");
        assert!(!base.join("x").exists() && !base.join("elsewhere").exists(), "nothing written outside");
        #[cfg(unix)]
        {
            std::fs::create_dir_all(base.join("outside")).expect("dir");
            std::fs::create_dir_all(&root).expect("root");
            std::os::unix::fs::symlink(base.join("outside"), root.join("linked")).expect("symlink");
            refused(&root.join("linked"), "a__single");
            assert_eq!(std::fs::read_dir(base.join("outside")).expect("read").count(), 0);
        }
        // Inside the root it writes as before.
        let ok = check(&root, &root.join("fixtures"), &one("a__single"), UpdateMode::New).expect("inside");
        assert_eq!(ok.changes.len(), 1);
        assert!(root.join("fixtures/a__single.snap.new").is_file());
        let _ = std::fs::remove_dir_all(&base);
    }

    #[test]
    fn the_snapshot_dir_refuses_a_suite_name_that_is_not_a_file_name() {
        let report = |suite: &str, device: &str| -> Report {
            serde_json::from_value(serde_json::json!({
                "schema": 1, "suite": suite, "suite_file": "s.toml", "parity_version": "0",
                "environment": {"mlx_version": "0", "device": device, "os": "linux", "arch": "x86_64"},
                "shard": null, "faults": [], "checkpoints": [], "rows": [],
                "summary": {"rows": 0, "passed": 0, "failed": 0, "skipped": 0, "by_verdict": {},
                            "snapshot_changes": [], "seconds": 0.0}
            }))
            .expect("report")
        };
        let root = Path::new("reports");
        assert_eq!(dir(root, &report("fixtures", "cpu")).expect("plain"), root.join("fixtures"));
        assert_eq!(dir(root, &report("fixtures", "gpu")).expect("plain"), root.join("fixtures/gpu"));
        for bad in ["../../../x", "/etc", "..", "a/b"] {
            assert!(dir(root, &report(bad, "cpu")).is_err(), "{bad}");
        }
        assert!(dir(root, &report("fixtures", "../x")).is_err());
    }

    /// CUDA results are not Metal's (other kernels, other roundings): a CUDA run accepted into
    /// `gpu/` would fail every Mac's run, and the other way round.
    #[test]
    fn cuda_snapshots_live_apart_from_metal_and_cpu_ones() {
        let report = |device: &str, backend: Option<&str>| -> Report {
            let mut env = serde_json::json!({"mlx_version": "0", "device": device, "os": "linux", "arch": "x86_64"});
            if let Some(b) = backend {
                env["backend"] = b.into();
            }
            serde_json::from_value(serde_json::json!({
                "schema": 1, "suite": "fixtures", "suite_file": "s.toml", "parity_version": "0",
                "environment": env, "shard": null, "faults": [], "checkpoints": [], "rows": [],
                "summary": {"rows": 0, "passed": 0, "failed": 0, "skipped": 0, "by_verdict": {},
                            "snapshot_changes": [], "seconds": 0.0}
            }))
            .expect("report")
        };
        let root = Path::new("reports");
        assert_eq!(dir(root, &report("gpu", Some("cuda"))).expect("cuda"), root.join("fixtures/cuda"));
        assert_eq!(dir(root, &report("gpu", Some("metal"))).expect("metal"), root.join("fixtures/gpu"));
        assert_eq!(dir(root, &report("gpu", None)).expect("unnamed"), root.join("fixtures/gpu"));
        assert_eq!(dir(root, &report("cpu", None)).expect("cpu"), root.join("fixtures"));
    }

    #[test]
    fn yaml_strings_quote_what_yaml_would_misread() {
        assert_eq!(yaml_str("llama-tiny"), "llama-tiny");
        assert_eq!(yaml_str("true"), "\"true\"");
        assert_eq!(yaml_str("37"), "\"37\"");
        assert_eq!(yaml_str("a: b"), "\"a: b\"");
        assert_eq!(yaml_str("line\nbreak"), "\"line\\nbreak\"");
    }
}
