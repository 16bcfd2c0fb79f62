//! The report renderings (terminal table, JUnit, Markdown), shard merging and the text diff,
//! on a hand-built report that has one of everything a reviewer may meet.

use std::collections::BTreeMap;

use parity::Choice;
use parity::report::diff::text_diff;
use parity::report::merge::merge;
use parity::report::{
    ApiFacts, CheckpointReport, CheckpointStatus, DivergenceReport, Environment, Phase, Report, Row, SCHEMA_VERSION,
    Shard, StepPlace, Summary, html, junit, markdown, table,
};
use parity::vocab::Settings;
use parity::vocab::Verdict;
use parity::vocab::{Evidence, Status as Shown};

const NOT_FOUND: &str = "checkpoint `Qwen/Qwen3-0.6B` not found; looked in:
  - /work/suites/Qwen/Qwen3-0.6B
  - /home/ci/.cache/huggingface/hub/models--Qwen--Qwen3-0.6B
parity never downloads. Fetch it on a machine with network access, e.g.
  huggingface-cli download Qwen/Qwen3-0.6B
(or set HF_HUB_CACHE / HF_HOME to a cache that has it)";

fn row(checkpoint: &str, scenario: &str, case: &str, path: &str, verdict: Verdict) -> Row {
    let ran = !matches!(verdict, Verdict::Error | Verdict::Skipped);
    Row {
        pass: verdict != Verdict::Error,
        tokens: if ran { vec![576, 6722, 315, 9625] } else { vec![] },
        reference_tokens: if ran { vec![576, 6722, 315, 9625] } else { vec![] },
        text: ran.then(|| "The capital of France is Paris.".into()),
        reference_text: ran.then(|| "The capital of France is Paris.".into()),
        max_rel_rms: ran.then_some(0.0),
        max_kl: ran.then_some(0.0),
        step_rel_rms: if ran { vec![Some(0.0); 4] } else { vec![] },
        noise_floor_rel_rms: ran.then_some(3.2e-6),
        paths: usize::from(ran),
        ..Row::new(checkpoint, "len37", scenario, case, path, verdict)
    }
}

fn divergence(step: usize, path: usize, kv_row: usize, block: Option<usize>) -> DivergenceReport {
    DivergenceReport {
        choice: Choice {
            step,
            reference_token: 12095,
            token: 88701,
            reference_top: vec![(12095, 18.25), (88701, 17.5), (279, 12.0)],
            top: vec![(88701, 18.125), (12095, 16.875), (279, 12.0)],
            reference_gap: 0.75,
            observed_shift: 1.375,
            tie_threshold: 1.375,
            mutual_top_k: true,
        },
        path,
        position: kv_row,
        position_mod_tile: kv_row % 32,
        kv_row,
        block_index: block,
        offset_in_block: block.map(|_| kv_row % 16),
        pads_trimmed: 0,
        batch_row: path,
        batch_size: 1,
    }
}

fn checkpoint(name: &str, reference: &str, status: CheckpointStatus) -> CheckpointReport {
    let ran = status == CheckpointStatus::Ran;
    CheckpointReport {
        name: name.into(),
        reference: reference.into(),
        resolved: ran.then(|| format!("/work/target/fixtures/{name}")),
        status,
        reason: (!ran).then(|| NOT_FOUND.into()),
        dtype: if ran { "float32" } else { "auto" }.into(),
        dequantized: false,
        settings: Settings { block_size: 16, ..Settings::default() },
        max_rel_rms_tolerance: 1e-2,
        max_logprob_delta_tolerance: None,
        bitwise: false,
        allowed_verdicts: vec![Verdict::Identical, Verdict::NearTie],
        no_snapshot: None,
        phases: if ran {
            vec![
                Phase { name: "load".into(), seconds: 0.25 },
                Phase { name: "reference".into(), seconds: 1.5 },
                Phase { name: "single dense".into(), seconds: 0.5 },
            ]
        } else {
            vec![]
        },
        noise_floor: if ran { BTreeMap::from([("len37".to_string(), Some(3.2e-6))]) } else { BTreeMap::new() },
        prompt_ids: if ran { BTreeMap::from([("len37".to_string(), vec![9707, 11, 1879])]) } else { BTreeMap::new() },
        engine: None,
        reference_engine: None,
        reference_path: None,
    }
}

fn report() -> Report {
    let tiny = "qwen3-tiny";
    let mut rows = vec![
        row(tiny, "single", "plain", "dense", Verdict::Identical),
        row(tiny, "single", "plain", "paged", Verdict::Identical),
    ];

    let mut tie = row(tiny, "batch2", "same", "paged", Verdict::NearTie);
    tie.paths = 2;
    tie.max_rel_rms = Some(2.1e-5);
    tie.first_divergence = Some(divergence(9, 1, 45, Some(2)));
    tie.notes = vec!["rows 37 and 37, same prompt".into()];
    rows.push(tie);

    rows.push(row(tiny, "padded", "tile", "dense", Verdict::Identical));
    let mut bad = row(tiny, "padded", "tile", "paged", Verdict::Diverged);
    bad.pass = false;
    bad.failure = Some("diverged at step 1 (position 37); max relative RMS 4.100e-2 > tolerance 1.0e-2".into());
    let mut d = divergence(1, 0, 37, Some(2));
    d.pads_trimmed = 27;
    d.choice.mutual_top_k = false;
    bad.first_divergence = Some(d);
    bad.tokens = vec![576, 88701, 315, 9625];
    bad.text = Some("The capital of France is Lyon.".into());
    bad.max_rel_rms = Some(4.1e-2);
    bad.max_kl = Some(2.5e-1);
    bad.notes = vec!["padded 37 -> 64, trimmed 27".into()];
    bad.step_rel_rms = vec![Some(0.0), Some(4.1e-2), None, Some(2.5e-2)];
    bad.step_kl = vec![Some(0.0), Some(2.5e-1), None, Some(1.0e-1)];
    let place = |k: usize| StepPlace { step: 0, kv_row: 63 + k, position: 36 + k, pads_trimmed: 27, rolled_back: 0 };
    bad.step_layout = StepPlace::runs((0..4).map(place));
    assert_eq!(bad.step_layout.len(), 1, "one run");
    bad.block_size = Some(16);
    rows.push(bad);

    let mut err = row(tiny, "chunked", "*", "paged", Verdict::Error);
    err.pass = false;
    err.failure = Some("chunked on paged: pool exhausted: 4 blocks requested, 3 free".into());
    rows.push(err);

    let mut drift = row(tiny, "rollback", "k4", "paged", Verdict::Identical);
    drift.pass = false;
    drift.failure = Some("max relative RMS 3.000e-2 > tolerance 1.0e-2".into());
    drift.max_rel_rms = Some(3e-2);
    drift.step_rel_rms = vec![Some(1e-3), Some(2e-3), Some(3e-2), Some(4e-3)];
    drift.noise_floor_rel_rms = Some(0.0);
    drift.notes = vec!["3 rollbacks of 4 rows".into()];
    rows.push(drift);

    // Right tokens from a path that recomputed what it said it shared: every renderer shows
    // the claim that lacked its evidence beside the one that had it.
    let mut hollow = row(tiny, "prefix", "after-finish", "paged", Verdict::Vacuous);
    hollow.pass = false;
    let evidence = |claim: &str, wanted: &str, seen: &str, status| Evidence {
        claim: claim.into(),
        wanted: wanted.into(),
        seen: seen.into(),
        status,
    };
    hollow.evidence = vec![
        evidence(
            "crosses-blocks",
            "reads that span blocks (a sequence of 21 rows, blocks of 16)",
            "4 model calls whose read spanned blocks",
            Shown::Held,
        ),
        evidence(
            "shared",
            "9 prefix rows reused (shared or copied), not recomputed",
            "the engine said 9 rows shared, yet it computed 30 token positions for the 21 parity fed: 9 rows recomputed",
            Shown::Missing,
        ),
    ];
    hollow.failure =
        Some(format!("vacuous: shared: wanted {}; {}", hollow.evidence[1].wanted, hollow.evidence[1].seen));
    rows.push(hollow);

    for backend in ["dense", "paged"] {
        let mut s = row("qwen3-0.6b", "single", "*", backend, Verdict::Skipped);
        s.pass = true;
        s.notes = vec![NOT_FOUND.lines().next().unwrap_or_default().into()];
        rows.push(s);
    }

    let mut summary = Summary::of(&rows);
    // One changed and one new snapshot: every renderer names them as `parity review` does.
    summary.snapshot_changes =
        vec!["reports/qwen3/qwen3-tiny__padded.snap".into(), "reports/qwen3/qwen3-tiny__prefix.snap".into()];
    summary.snapshot_new = vec!["reports/qwen3/qwen3-tiny__prefix.snap".into()];
    summary.seconds = 12.5;
    Report {
        schema: SCHEMA_VERSION,
        suite: "qwen3".into(),
        suite_file: "suites/qwen3.toml".into(),
        parity_version: "0.1.0".into(),
        parity_commit: "0123456789ab".into(),
        environment: Environment {
            mlx_version: "0.25.1".into(),
            device: "cpu".into(),
            backend: None,
            gpu: None,
            os: "linux".into(),
            arch: "x86_64".into(),
            blas: None,
            allocator: None,
            mlx_jit: None,
            mlx_enable_tf32: None,
            reference_devices: Default::default(),
        },
        shard: None,
        faults: vec![],
        checkpoints: vec![
            checkpoint(tiny, "fixtures/qwen3-tiny.toml", CheckpointStatus::Ran),
            checkpoint("qwen3-0.6b", "Qwen/Qwen3-0.6B", CheckpointStatus::Skipped),
        ],
        rows,
        summary,
    }
}

#[test]
fn table() {
    let r = report();
    let plain = table::render(&r, false);
    assert!(!plain.contains('\x1b'), "plain output has escapes");
    insta::assert_snapshot!("table", plain);
}

#[test]
fn table_colors_only_when_asked() {
    let colored = table::render(&report(), true);
    assert!(colored.contains("\x1b[32mPASS\x1b[0m"));
    assert!(colored.contains("\x1b[31mFAIL\x1b[0m"));
    assert!(colored.contains("\x1b[33mSKIP\x1b[0m"));
    let stripped =
        colored.replace("\x1b[31m", "").replace("\x1b[32m", "").replace("\x1b[33m", "").replace("\x1b[0m", "");
    assert_eq!(stripped, table::render(&report(), false));
}

#[test]
fn junit() {
    insta::assert_snapshot!("junit", junit::render(&report()));
}

#[test]
fn markdown() {
    insta::assert_snapshot!("markdown", markdown::render(&report()));
}

#[test]
fn html() {
    insta::assert_snapshot!("html", html::render(&report()));
}

/// A suite is untrusted input: names, prompts, reasons and decoded text cannot inject markup.
#[test]
fn html_escapes_everything_from_the_report() {
    let mut r = report();
    let evil = "<script>alert('x')</script>";
    r.suite = evil.into();
    r.checkpoints[0].name = format!("tiny{evil}");
    for row in r.rows.iter_mut().filter(|row| row.checkpoint == "qwen3-tiny") {
        row.checkpoint = format!("tiny{evil}");
        row.prompt = format!("p\"{evil}&");
    }
    r.rows[4].failure = Some(format!("bad {evil}"));
    r.rows[4].text = Some(format!("Lyon {evil}"));
    r.rows[4].notes = vec![evil.into()];
    r.checkpoints[1].reason = Some(evil.into());
    r.summary.snapshot_changes = vec![evil.into()];
    r.faults = vec![evil.into()];
    let page = html::render(&r);
    assert!(!page.contains("<script"), "unescaped script tag");
    assert!(!page.contains("'x'"), "unescaped quote");
    assert!(page.contains("&lt;script&gt;alert(&apos;x&apos;)&lt;/script&gt;"));
    assert!(page.contains("p&quot;&lt;script&gt;"));
    assert_eq!(parity::report::escape::xml("a<b>&\"c'\u{7}"), "a&lt;b&gt;&amp;&quot;c&apos;\\u{7}");
}

#[test]
fn renderings_are_stable() {
    let r = report();
    assert_eq!(html::render(&r), html::render(&r.clone()));
    assert_eq!(table::render(&r, false), table::render(&r.clone(), false));
    assert_eq!(junit::render(&r), junit::render(&r.clone()));
    assert_eq!(markdown::render(&r), markdown::render(&r.clone()));
}

/// A checkpoint that would not load fails every row for one reason: said once, not per row.
#[test]
fn checkpoint_error_is_said_once() {
    let mut r = report();
    let broken = &mut r.checkpoints[1];
    broken.status = CheckpointStatus::Error;
    broken.reason = Some("config.json: field `head_dim`: expected an integer\nat line 12".into());
    for row in r.rows.iter_mut().filter(|row| row.checkpoint == "qwen3-0.6b") {
        row.verdict = Verdict::Error;
        row.pass = false;
        row.failure = broken.reason.clone();
    }
    r.summary = Summary::of(&r.rows);
    let t = table::render(&r, false);
    assert_eq!(t.matches("field `head_dim`").count(), 1, "{t}");
    assert!(t.contains("FAIL qwen3-0.6b: checkpoint error, 2 rows not run\n"), "{t}");
    assert!(!t.contains("FAIL qwen3-0.6b/"), "{t}");
    let md = markdown::render(&r);
    assert_eq!(md.matches("field `head_dim`").count(), 1, "{md}");
    let xml = junit::render(&r);
    assert_eq!(xml.matches("<error message=\"config.json").count(), 2, "{xml}");
}

#[test]
fn nan_and_missing_noise_floor() {
    let mut r = report();
    r.rows[4].max_rel_rms = None;
    r.rows[4].nan = true;
    r.rows[6].noise_floor_rel_rms = None;
    let t = table::render(&r, false);
    assert!(t.contains("rel RMS     NaN (a poisoned or freed row was read)"), "{t}");
    assert!(t.contains("max 3.000e-2, no noise floor"), "{t}");
}

#[test]
fn xml_escaping() {
    assert_eq!(
        parity::report::escape::xml("<a href=\"x\">&'b'</a>"),
        "&lt;a href=&quot;x&quot;&gt;&amp;&apos;b&apos;&lt;/a&gt;"
    );
    // Tabs and newlines survive attribute normalisation; what XML 1.0 cannot carry is shown.
    assert_eq!(parity::report::escape::xml("a\tb\nc\r"), "a&#9;b&#10;c&#13;");
    assert_eq!(parity::report::escape::xml("\u{0}\u{1b}x\u{ffff}"), "\\u{0}\\u{1b}x\\u{ffff}");
    assert_eq!(parity::report::escape::xml("naïve 東京"), "naïve 東京");

    let mut r = report();
    r.rows[4].failure = Some("bad <tag> & \"quote\" \u{7}".into());
    let xml = junit::render(&r);
    assert!(xml.contains("message=\"bad &lt;tag&gt; &amp; &quot;quote&quot; \\u{7}\""));
    assert!(!xml.chars().any(|c| c.is_control() && c != '\n'));
}

/// The report split as `--shard 1/2` and `--shard 2/2` would: units alternate between shards,
/// both shards load the checkpoint (and time it), each reports its own rows.
fn shards() -> (Report, Report) {
    let full = report();
    let mut a = full.clone();
    let mut b = full.clone();
    a.shard = Some(Shard { index: 1, count: 2 });
    b.shard = Some(Shard { index: 2, count: 2 });
    let in_a = |r: &Row| matches!(r.scenario.as_str(), "single" | "padded") && r.checkpoint == "qwen3-tiny";
    a.rows.retain(|r| in_a(r));
    b.rows.retain(|r| !in_a(r));
    a.checkpoints.truncate(1);
    b.checkpoints[0].phases[2].name = "batch2 paged".into();
    b.checkpoints[0].noise_floor.insert("len37".into(), Some(4.0e-6));
    a.summary = Summary::of(&a.rows);
    a.summary.seconds = 5.0;
    b.summary = Summary::of(&b.rows);
    b.summary.seconds = 7.5;
    b.summary.snapshot_changes = full.summary.snapshot_changes.clone();
    b.summary.snapshot_new = full.summary.snapshot_new.clone();
    (a, b)
}

#[test]
fn merge_two_shards() {
    let (a, b) = shards();
    let ab = merge(vec![a.clone(), b.clone()]).expect("merge");
    let ba = merge(vec![b, a]).expect("merge");
    assert_eq!(ab, ba, "order of the shard files matters");

    let full = report();
    assert_eq!(ab.shard, None);
    assert_eq!(ab.rows, full.rows, "rows not in suite order");
    assert_eq!(ab.summary, full.summary);
    let names: Vec<&str> = ab.checkpoints.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["qwen3-tiny", "qwen3-0.6b"]);
    let tiny = &ab.checkpoints[0];
    let phases: Vec<(&str, f64)> = tiny.phases.iter().map(|p| (p.name.as_str(), p.seconds)).collect();
    assert_eq!(phases, [("load", 0.5), ("reference", 3.0), ("single dense", 0.5), ("batch2 paged", 0.5)]);
    assert_eq!(tiny.noise_floor["len37"], Some(4.0e-6));
    assert_eq!(ab.checkpoints[1].status, CheckpointStatus::Skipped);
}

#[test]
fn merge_takes_the_worst_checkpoint_status() {
    let (a, mut b) = shards();
    b.checkpoints[0].status = CheckpointStatus::Skipped;
    b.checkpoints[0].reason = Some("not on this runner".into());
    let m = merge(vec![a, b]).expect("merge");
    assert_eq!(m.checkpoints[0].status, CheckpointStatus::Skipped);
    assert_eq!(m.checkpoints[0].reason.as_deref(), Some("not on this runner"));
    assert_eq!(m.checkpoints[0].dtype, "float32", "dtype from the shard that ran");
}

#[test]
fn merge_rejects_what_does_not_add_up() {
    let (a, mut b) = shards();
    let err = |r: Result<Report, String>| r.expect_err("should not merge");

    b.suite = "llama".into();
    assert!(err(merge(vec![a.clone(), b.clone()])).contains("different suite"));

    let (_, b) = shards();
    assert!(err(merge(vec![a.clone()])).contains("missing shard report(s): 2/2"));
    assert!(err(merge(vec![a.clone(), a.clone(), b.clone()])).contains("given twice"));
    assert!(err(merge(vec![])).contains("no reports"));

    let mut c = b.clone();
    c.shard = Some(Shard { index: 2, count: 3 });
    assert!(err(merge(vec![a.clone(), c])).contains("different splits"));

    // Unsharded reports split by hand must not overlap.
    let (mut a, mut b) = (a, b);
    a.shard = None;
    b.shard = None;
    b.rows.push(a.rows[0].clone());
    assert!(err(merge(vec![a, b])).contains("qwen3-tiny/len37/single:plain/dense"));
}

#[test]
fn text_diff_of_equal_strings_has_no_markers() {
    let s = "The capital of France is Paris.\n";
    assert_eq!(text_diff(s, s), "The capital of France is Paris.\\n");
    assert_eq!(text_diff("", ""), "");
}

#[test]
fn text_diff_marks_one_word() {
    assert_eq!(
        text_diff("The capital is Paris, France", "The capital is Lyon, France"),
        "The capital is [-Paris-]{+Lyon+}, France"
    );
    assert_eq!(text_diff("a b c", "x y z"), "[-a b c-]{+x y z+}");
    assert_eq!(text_diff("a\nb", "a b"), "a[-\\n-]{+ +}b");
    assert_eq!(text_diff("sum", "sum = 1"), "sum{+ = 1+}");
}

#[test]
fn text_diff_shortens_long_context() {
    let head = "word ".repeat(30);
    let d = text_diff(&format!("{head}one"), &format!("{head}two"));
    assert!(d.starts_with("...word"), "{d}");
    assert!(d.ends_with(" [-one-]{+two+}"), "{d}");
    assert!(d.len() < 80, "{d}");
}

/// A server's row (kind = "openai") has no logits, only logprobs: its chart plots the largest
/// |delta logprob| per step against the logprob tolerance (#16 left these rows without a curve,
/// so the HTML report showed nothing for the engines users test most).
#[test]
fn html_draws_logprob_curves_for_server_rows() {
    let mut r = report();
    r.checkpoints[0].max_logprob_delta_tolerance = Some(0.1);
    let mut api = row("qwen3-tiny", "single", "plain", "q8-kv", Verdict::Identical);
    api.pass = false;
    api.failure = Some("max |delta logprob| 1.26 > tolerance 0.1".into());
    api.step_rel_rms = vec![];
    api.max_rel_rms = None;
    api.api = Some(ApiFacts {
        max_logprob_delta: 1.26,
        step_logprob_delta: vec![0.19, 1.26, 0.0, 0.4],
        prompt_tokens: 37,
        ..ApiFacts::default()
    });
    r.rows.push(api);
    let page = html::render(&r);
    let panel = &page[page.find("qwen3-tiny/len37/single:plain/q8-kv").expect("the row has a panel")..];
    assert!(panel.contains("largest |Δ logprob| per step"), "a full chart of logprobs");
    assert!(panel.contains("step 1: |Δ logprob| 1.260e0"), "each step's value in its tooltip");
    assert!(panel.contains("<title>tolerance 1.0e-1</title>"), "the logprob tolerance, not the RMS one");
    assert!(panel.contains("● |Δ logprob|"), "the legend names the curve");
    assert!(page.contains("max |Δ logprob| 1.260e0"), "the small multiple's summary");
}

/// A `no_snapshot` checkpoint (a server whose failing rows follow request timing) yields no
/// snapshot, so its run-to-run changes never read as a code change; the other checkpoints
/// keep theirs, and the table and Markdown say why it has none, every run.
#[test]
fn a_no_snapshot_checkpoint_is_judged_but_not_snapshotted() {
    let mut r = report();
    let all = parity::report::snapshot::render(&r);
    let why = "which rows fail follows request timing";
    r.checkpoints[0].no_snapshot = Some(why.into());
    let name = r.checkpoints[0].name.clone();
    assert!(all.keys().any(|k| k.starts_with(&format!("{name}__"))), "{:?}", all.keys());
    let left = parity::report::snapshot::render(&r);
    let prefix = format!("{name}__");
    let others: Vec<&String> = all.keys().filter(|k| !k.starts_with(&prefix)).collect();
    assert_eq!(left.keys().collect::<Vec<_>>(), others);
    assert!(table::render(&r, false).contains(&format!("not snapshotted: {name}: {why}")));
    assert!(markdown::render(&r).contains(&format!("### Not snapshotted\n\n- `{name}`: {why}")));
    // The rows are still judged: the failing row still fails the report.
    assert!(r.failed());
}
