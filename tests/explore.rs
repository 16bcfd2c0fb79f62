//! `parity explore`: random schedules find what the fixed scenarios find, without them, and
//! shrink it to a reproducer a suite can pin.

use crate::common;

use parity::faults::{self, Fault, Faults};
use parity::report::{Report, Row};
use parity::vocab::Verdict;
use parity::{ExploreBudget, NoProgress, RunOptions, run_suite};

fn explore(suite: &str, filter: &str, seed: u64, schedules: usize, faults: Faults) -> Report {
    common::cpu();
    let suite = parity::load_suite(&common::repo().join("suites").join(suite)).unwrap_or_else(|e| panic!("{e}"));
    let opts = RunOptions {
        filter: Some(filter.into()),
        faults,
        // One finding a path is enough to show a fault is found; shrinking each costs replays.
        explore: Some(ExploreBudget { seed, schedules: Some(schedules), findings: 1, ..ExploreBudget::default() }),
        ..RunOptions::default()
    };
    run_suite(&suite, &opts, &NoProgress)
}

fn reproducer(row: &Row) -> &str {
    row.notes.iter().find_map(|n| n.strip_prefix("reproducer: ")).unwrap_or_else(|| panic!("no reproducer: {row:?}"))
}

/// What must not vary for a seed: the rows, their verdicts, their reproducers (timings aside).
fn outcome(r: &Report) -> Vec<(String, Verdict, Option<String>)> {
    r.rows
        .iter()
        .map(|row| (row.id(), row.verdict, row.notes.iter().find(|n| n.starts_with("reproducer")).cloned()))
        .collect()
}

#[test]
fn a_seed_gives_the_same_schedules_verdicts_and_reproducers() {
    let run = |seed| explore("fixtures.toml", "llama-tiny/", seed, 12, Faults::only(Fault::GatherOffByOne));
    let (a, b) = (run(7), run(7));
    assert!(a.summary.failed > 0, "the planted fault is found: {:?}", outcome(&a));
    assert_eq!(outcome(&a), outcome(&b));
    assert_ne!(outcome(&a), outcome(&run(8)), "another seed explores other schedules");
}

/// Every planted fault, found with no fixed scenario involved and shrunk to a handful of
/// operations; the same paths explored clean find nothing.
#[test]
fn every_planted_fault_is_found_and_shrunk_and_clean_paths_pass() {
    let clean = explore("fixtures.toml", "llama-tiny/", 1, 40, Faults::NONE);
    assert_eq!(clean.summary.failed, 0, "{:#?}", clean.rows);
    assert!(clean.rows.iter().all(|r| r.notes.iter().any(|n| n.contains("no failure"))), "{:#?}", clean.rows);
    for &fault in faults::ALL {
        // A window fault needs a sliding window: the windowed fixture (Llama has none).
        let on = if fault == Fault::WindowReleaseEarly { "gemma3-tiny/" } else { "llama-tiny/" };
        let r = explore("fixtures.toml", on, 1, 100, Faults::only(fault));
        let found: Vec<&Row> = r.rows.iter().filter(|r| !r.pass).collect();
        assert!(!found.is_empty(), "{} not found: {:#?}", fault.name(), r.rows);
        // A window fault needs a sequence past its window of 10 whose query's window starts
        // at a block's last row; the shrinker removes operations but does not merge decode
        // steps into one prefill, so its reproducers keep the steps that got there.
        let most = if fault == Fault::WindowReleaseEarly { 12 } else { 7 };
        for row in found {
            let ops = reproducer(row).split("; ").count();
            assert!(ops <= most, "{}: {} shrunk to {ops} operations: {}", fault.name(), row.id(), reproducer(row));
        }
    }
}

/// A reproducer explore prints is pinned as it is printed ([[scripts]]) and runs as a row of
/// `parity run`: failing with the fault planted, passing without, on every path.
#[test]
fn a_pinned_reproducer_is_a_row_of_parity_run() {
    let found = explore("fixtures.toml", "llama-tiny/", 3, 40, Faults::only(Fault::BlockLeak));
    let leak = found.rows.iter().find(|r| !r.pass).expect("the leak is found");
    let script = reproducer(leak);
    let fixture = common::repo().join("fixtures/llama-tiny.toml");
    let text = std::fs::read_to_string(common::repo().join("suites/fixtures.toml")).unwrap();
    let prompts: String = text
        .split("\n[[prompts]]")
        .skip(1)
        .map(|p| format!("\n[[prompts]]{}", p.split("\n[[checkpoints]]").next().unwrap()))
        .collect();
    let suite_text = format!(
        "name = \"pinned\"\nscenarios = [\"script\"]\n[settings]\nmax_tokens = 12\nblock_size = 8\ntile = 16\nchunk = 5\n{prompts}\n\
         [[scripts]]\nname = \"leak\"\nops = \"{script}\"\n\n[[checkpoints]]\npath = \"{}\"\n",
        fixture.display()
    );
    let file = common::scratch("pinned").join("pinned.toml");
    std::fs::write(&file, &suite_text).unwrap();
    let suite = parity::load_suite(&file).unwrap_or_else(|e| panic!("{e}\n{suite_text}"));
    let run = |faults| run_suite(&suite, &RunOptions { faults, ..RunOptions::default() }, &NoProgress);
    let clean = run(Faults::NONE);
    assert_eq!(clean.rows.len(), 2, "one row per path: {:#?}", clean.rows);
    assert!(clean.rows.iter().all(|r| r.pass && r.scenario == "script" && r.case == "leak"), "{:#?}", clean.rows);
    let planted = run(Faults::only(Fault::BlockLeak));
    let paged = planted.rows.iter().find(|r| r.path == "paged").expect("paged row");
    assert!(!paged.pass && paged.failure.as_deref().unwrap_or_default().contains("KV pool books"), "{paged:#?}");
    // A filter names a pinned script's row like any other (a `--bisect` on it must run it):
    // the planning that decides what a filter selects runs the scripts too.
    let id = paged.id();
    let filtered = run_suite(&suite, &RunOptions { filter: Some(id.clone()), ..RunOptions::default() }, &NoProgress);
    let ids: Vec<String> = filtered.rows.iter().map(|r| r.id()).collect();
    assert_eq!(ids, [id], "{:#?}", filtered.rows);
}
