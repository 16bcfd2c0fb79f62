//! Issue #14, item 5: a row that tested nothing of its scenario is `skipped` with the reason,
//! never a pass, and a case a scenario cannot form is a skipped row, never a missing one.
//! (What the settings alone make vacuous is a parse error: tests/suite_errors.rs.)

use crate::common;

use parity::Builtin;

use parity::Setup;
use parity::faults::Faults;
use parity::kv::Backend;
use parity::report::Row;
use parity::vocab::Verdict;
use parity::vocab::audit;
use parity::vocab::{Prompt, Scenario, Settings};
use parity::{NoProgress, RunOptions, run_suite};

fn run(prompts: &str, scenarios: &str, settings: &str) -> Vec<Row> {
    common::cpu();
    let fixture = common::repo().join("fixtures/llama-tiny.toml");
    let text = format!(
        "name = \"cov\"\nscenarios = [{scenarios}]\nbackends = [\"paged\"]\n[settings]\n{settings}\n{prompts}\n\
         [[checkpoints]]\npath = \"{}\"\n",
        fixture.display()
    );
    let file = common::scratch("coverage").join("cov.toml");
    let suite = parity::parse_suite(&file, &text).expect("suite parses");
    let report = run_suite(&suite, &RunOptions::default(), &NoProgress);
    assert_eq!(report.summary.failed, 0, "{:#?}", report.rows.iter().filter(|r| !r.pass).collect::<Vec<_>>());
    report.rows
}

fn row<'a>(rows: &'a [Row], prompt: &str, scenario: &str, case: &str) -> &'a Row {
    rows.iter()
        .find(|r| r.prompt == prompt && r.scenario == scenario && r.case == case)
        .unwrap_or_else(|| panic!("no row {prompt}/{scenario}/{case} in {:?}", names(rows)))
}

fn names(rows: &[Row]) -> Vec<String> {
    rows.iter().map(|r| format!("{}/{}/{}: {}", r.prompt, r.scenario, r.case, r.verdict.name())).collect()
}

fn skipped_because(r: &Row, why: &str) {
    assert_eq!(r.verdict, Verdict::Skipped, "{r:?}");
    assert!(r.pass && r.failure.is_none());
    assert!(r.notes.iter().any(|n| n.contains(why)), "expected `{why}` in {:?}", r.notes);
}

/// Was: a prompt shorter than the chunk passed `chunked`, a tile-aligned prompt passed the
/// `padded` tile case with nothing trimmed, and a prompt too short to share vanished from
/// `prefix` without a row. Lengths are unknown to the parser (plain text, byte tokenizer).
#[test]
fn prompt_dependent_vacuous_rows_are_skipped_with_the_reason() {
    let prompts = "[[prompts]]\nname = \"two\"\ntext = \"ab\"\n\
                   [[prompts]]\nname = \"sixteen\"\ntext = \"0123456789abcdef\"\n";
    let rows =
        run(prompts, "\"chunked\", \"padded\", \"prefix\"", "max_tokens = 4\nblock_size = 4\ntile = 16\nchunk = 5");
    skipped_because(row(&rows, "two", "chunked", "c5"), "the 2-token prompt fits in one chunk of 5");
    assert_eq!(row(&rows, "sixteen", "chunked", "c5").verdict, Verdict::Identical);
    skipped_because(
        row(&rows, "sixteen", "padded", "tile"),
        "no pad rows: the 16-token prompt fills whole tiles of 16",
    );
    assert_eq!(row(&rows, "two", "padded", "tile").verdict, Verdict::Identical, "2 -> 16 pads and trims 14");
    // batch-left always has masked pads: never skipped.
    assert_eq!(row(&rows, "sixteen", "padded", "batch-left").verdict, Verdict::Identical);
    skipped_because(row(&rows, "two", "prefix", "*"), "the 2-token prompt is too short to share");
    assert_eq!(row(&rows, "sixteen/shared15", "prefix", "after-finish").verdict, Verdict::Identical);
}

/// Was: with every prompt of one length, `batch2` ragged and `padded` batch-right produced no
/// row at all for them.
#[test]
fn cases_without_a_partner_are_skipped_rows_not_missing_ones() {
    let prompts = "[[prompts]]\nname = \"a\"\ntext = \"abcdefghi\"\n[[prompts]]\nname = \"b\"\ntext = \"ihgfedcba\"\n";
    let rows = run(prompts, "\"batch2\", \"padded\"", "max_tokens = 3\nblock_size = 4\ntile = 16");
    for p in ["a", "b"] {
        assert_eq!(row(&rows, p, "batch2", "same").verdict, Verdict::Identical);
        skipped_because(row(&rows, p, "batch2", "ragged"), "no prompt of another length than 9 tokens");
        skipped_because(row(&rows, p, "padded", "batch-right"), "no prompt of another length than 9 tokens");
    }
}

/// The parser's replay of the `concurrent` schedule must agree with the scenario's own, or
/// it would reject good settings or accept ones that never batch.
#[test]
fn the_concurrent_schedule_replay_matches_the_scenario() {
    let (model, _) = common::load(&common::fixture("llama-tiny"));
    let prompts: Vec<Prompt> = [5usize, 9]
        .iter()
        .map(|&n| Prompt { name: format!("p{n}"), ids: (0..n as u32).map(|i| 65 + i).collect() })
        .collect();
    let cases: [(usize, Vec<usize>, usize, usize); 5] = [
        (5, vec![0, 0, 2, 3, 6], 3, 8),
        (4, vec![0, 1, 3, 4], 2, 6),
        (2, vec![0, 20], 2, 4),
        (2, vec![0, 3], 2, 4),
        (3, vec![0], 1, 4),
    ];
    for (requests, arrivals, max_batch, max_tokens) in cases {
        let mut s = Settings { max_tokens, block_size: 4, ..Settings::default() };
        s.concurrent.requests = requests;
        s.concurrent.arrivals = arrivals.clone();
        s.concurrent.max_batch = max_batch;
        let mut reference = Builtin::new(&model, Backend::Dense, &s);
        let mut path = Builtin::new(&model, Backend::Paged, &s);
        let mut h = Setup::new(&mut reference, s.clone(), Faults::NONE, 0);
        let out = parity::run_scenario(Scenario::Concurrent, &mut h, &mut path, &prompts);
        assert!(out.iter().all(|c| c.outcome == parity::Outcome::Ran), "concurrent runs");
        let note = out[0].notes.iter().find(|n| n.contains("peak batch")).expect("peak batch note");
        let peak: usize = note.rsplit(' ').next().and_then(|x| x.parse().ok()).expect("a number");
        let replayed = audit::concurrent_peak_batch(&s);
        assert_eq!(replayed.min(2), peak.min(2), "{requests} {arrivals:?} {max_batch} {max_tokens}: {note}");
        // And a schedule that never batches is a skipped row at run time (the judge audits
        // every row's settings again), not a pass.
        let problems = audit::settings_problems(&s, &[Scenario::Concurrent], &[Backend::Paged], None);
        assert_eq!(!problems.is_empty(), peak < 2, "{problems:?}");
    }
}
