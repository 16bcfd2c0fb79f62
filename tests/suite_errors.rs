//! Every suite mistake is reported with file, line and column before anything runs.

use std::path::Path;

use parity::kv::Backend;

const GOOD: &str = r#"
name = "t"
[settings]
tile = 16
[[prompts]]
name = "p"
text = "hello"
[[checkpoints]]
path = "../fixtures/llama-tiny.toml"
"#;

fn err(text: &str) -> parity::SuiteError {
    parity::parse_suite(Path::new("suites/x.toml"), text).expect_err("suite should be rejected")
}

fn assert_at(text: &str, line: usize, needle: &str) {
    let e = err(text);
    assert_eq!(e.line, line, "{e}");
    assert!(e.column > 0, "{e}");
    assert!(e.to_string().starts_with(&format!("suites/x.toml:{line}:")), "{e}");
    assert!(e.message.contains(needle), "expected `{needle}` in: {e}");
}

#[test]
fn the_good_suite_parses() {
    let s = parity::parse_suite(Path::new("suites/x.toml"), GOOD).unwrap();
    assert_eq!(s.checkpoints[0].settings.tile, 16);
    assert_eq!(s.checkpoints[0].name, "llama-tiny");
}

#[test]
fn malformed_toml() {
    assert_at("name = \"t\"\n[settings\n", 2, "");
}

#[test]
fn unknown_key() {
    assert_at(&GOOD.replace("tile = 16", "tile = 16\ntiles = 3"), 5, "unknown field `tiles`");
}

#[test]
fn wrong_type() {
    assert_at(&GOOD.replace("tile = 16", "tile = \"big\""), 4, "invalid type");
}

#[test]
fn unknown_scenario() {
    let text = GOOD.replace("name = \"t\"", "name = \"t\"\nscenarios = [\"single\", \"speculative\"]");
    assert_at(&text, 3, "unknown scenario `speculative`; known: single, batch2");
}

#[test]
fn negative_and_zero_sizes() {
    assert_at(&GOOD.replace("tile = 16", "tile = 16\nblock_size = -4"), 5, "settings.block_size: -4 must be positive");
    assert_at(&GOOD.replace("tile = 16", "tile = 16\nmax_tokens = 0"), 5, "must be positive");
}

#[test]
fn tile_not_a_multiple_of_8() {
    assert_at(&GOOD.replace("tile = 16", "tile = 12"), 4, "settings.tile: 12 is not a multiple of 8");
}

#[test]
fn checkpoint_override_errors_point_into_the_checkpoint() {
    let text = format!("{GOOD}settings = {{ tile = 20 }}\n");
    assert_at(&text, 10, "not a multiple of 8");
}

#[test]
fn prompt_needs_exactly_one_source() {
    assert_at(
        &GOOD.replace("text = \"hello\"", "text = \"hello\"\nchat = \"hi\""),
        5,
        "exactly one of text, chat, ids or file",
    );
}

#[test]
fn unknown_dtype_and_backend() {
    assert_at(&GOOD.replace("name = \"t\"", "name = \"t\"\ndtype = \"float8\""), 3, "unknown dtype `float8`");
    assert_at(
        &GOOD.replace("name = \"t\"", "name = \"t\"\nbackends = [\"sparse\"]"),
        3,
        "unknown path `sparse`; this engine has dense, paged, dense-rowwise, paged-rowwise",
    );
    // The row-by-row paths run only when named, beside (or instead of) the batched ones.
    let both =
        GOOD.replace("name = \"t\"", "name = \"t\"\nbackends = [\"paged\", \"paged-rowwise\", \"dense-rowwise\"]");
    let s = parity::parse_suite(Path::new("suites/x.toml"), &both).unwrap();
    assert_eq!(s.checkpoints[0].paths, ["paged", "paged-rowwise", "dense-rowwise"]);
    assert_eq!(s.checkpoints[0].kv_backends(), [Backend::Paged, Backend::Dense]);
    let default = parity::parse_suite(Path::new("suites/x.toml"), GOOD).unwrap();
    assert_eq!(default.checkpoints[0].paths, ["dense", "paged"], "unnamed: the batched paths");
}

/// An engine table: each mistake names its line, before anything is started.
#[test]
fn engine_tables_are_checked_before_anything_starts() {
    // Lines: 2 name, 3 [engine], 4 kind, 5 command, 6 `extra`, then [engine.paths].
    let with = |engine: &str| GOOD.replace("name = \"t\"", &format!("name = \"t\"\n{engine}"));
    let process = |extra: &str, paths: &str| {
        with(&format!("[engine]\nkind = \"process\"\ncommand = [\"adapter\"]\n{extra}\n[engine.paths]\n{paths}\n"))
    };
    let good = process("", "a = []\nb = [\"--b\"]");
    let s = parity::parse_suite(Path::new("suites/x.toml"), &good).unwrap();
    assert_eq!(s.checkpoints[0].paths, ["a", "b"], "paths run in the order written");
    assert!(!s.checkpoints[0].engine.needs_builtin());
    assert_at(&with("[engine]\nkind = \"grpc\"\n"), 4, "unknown kind `grpc`");
    assert_at(&with("[engine]\nkind = \"process\"\n[engine.paths]\na = []\n"), 3, "needs `command`");
    assert_at(&process("", "a = []").replace("[\"adapter\"]", "[]"), 5, "give the program");
    assert_at(&with("[engine]\nkind = \"builtin\"\ncommand = [\"x\"]\n"), 5, "only for kind = \"process\"");
    assert_at(&process("reference = \"c\"", "a = []"), 6, "`c` is not a path of this engine");
    assert_at(&process("", "\"../up\" = []"), 7, "`../up`");
    assert_at(&process("timeout = 0", "a = []"), 6, "engine.timeout: 0");
    assert_at(
        &process("", "a = []").replace("name = \"t\"", "name = \"t\"\nbackends = [\"dense\"]"),
        3,
        "unknown path `dense`; this engine has a",
    );
    let s =
        parity::parse_suite(Path::new("suites/x.toml"), &process("reference = \"builtin:dense\"", "a = []")).unwrap();
    assert!(s.checkpoints[0].engine.needs_builtin());
}

#[test]
fn missing_prompts_or_checkpoints() {
    assert!(err("name = \"t\"\n").message.contains("needs at least one prompt"));
}

#[test]
fn env_expansion_in_paths() {
    let at = |path: &str| GOOD.replace("../fixtures/llama-tiny.toml", path);
    let s = parity::parse_suite(Path::new("suites/x.toml"), &at("${PARITY_TEST_SURELY_UNSET:-a/b}/c")).unwrap();
    assert_eq!(s.checkpoints[0].reference, "a/b/c");
    assert!(err(&at("${PARITY_TEST_SURELY_UNSET}")).message.contains("not set"));
}

// ---- issue #14: names that would escape the reports folder -----------------------------------

/// Was: `name = "../../../x"` made `parity run` write x/<checkpoint>__<scenario>.snap.new three
/// folders above reports/.
#[test]
fn a_suite_name_that_traverses_is_rejected_at_its_position() {
    assert_at(&GOOD.replace("name = \"t\"", "name = \"../../../x\""), 2, "suite name `../../../x` contains '/'");
    assert_at(&GOOD.replace("name = \"t\"", "name = \"/etc\""), 2, "suite name `/etc`");
    assert_at(&GOOD.replace("name = \"t\"", "name = \"..\""), 2, "starts with `.`");
}

#[test]
fn checkpoint_and_prompt_names_must_be_plain_file_names() {
    let text = GOOD.replace("path = \"../fixtures/llama-tiny.toml\"", "name = \"a/../../b\"\npath = \"x.toml\"");
    assert_at(&text, 9, "checkpoint name `a/../../b` contains '/'");
    assert_at(&GOOD.replace("name = \"p\"", "name = \"p\\\\q\""), 6, "prompt name `p\\\\q` contains '\\\\'");
    assert_at(&GOOD.replace("name = \"p\"", "name = \"\""), 6, "prompt name `` is empty");
    // A name derived from the path is checked too, at the path.
    assert_at(
        &GOOD.replace("../fixtures/llama-tiny.toml", ".."),
        9,
        "checkpoint name (from its path or repo; set `name`) `..`",
    );
}

#[test]
fn a_suite_file_whose_stem_is_not_a_file_name_needs_a_name() {
    let text = GOOD.replace("name = \"t\"\n", "");
    let e = parity::parse_suite(Path::new("suites/my suite.toml"), &text).expect_err("stem with a space");
    assert!(e.message.contains("suite name (from the file name; set `name`) `my suite` contains ' '"), "{e}");
    assert!(parity::parse_suite(Path::new("suites/ok-name.toml"), &text).is_ok());
}

/// kind = "openai": a path name names server logs and report ids, so it is one plain file-name
/// component like every other name; `settings.lengths` are prompt sizes, bounded like counts.
#[test]
fn openai_path_names_and_lengths_are_checked() {
    let openai = |paths: &str| {
        GOOD.replace(
            "name = \"t\"",
            &format!(
                "name = \"t\"\n[engine]\nkind = \"openai\"\ncommand = [\"srv\", \"{{port}}\"]\n[engine.paths]\n{paths}"
            ),
        )
    };
    assert!(parity::parse_suite(Path::new("suites/x.toml"), &openai("a = []\nb = []")).is_ok());
    // Lines: 2 name, 3 [engine], 4 kind, 5 command, 6 [engine.paths].
    assert_at(&openai("\"../up\" = []"), 6, "`../up` contains '/'");
    assert_at(&openai("\".hidden\" = []"), 6, "starts with `.`");
    let lengths = |l: &str| openai("a = []").replace("tile = 16", &format!("tile = 16\nlengths = {l}"));
    assert!(parity::parse_suite(Path::new("suites/x.toml"), &lengths("[15, 16]")).is_ok());
    assert_at(&lengths("[0]"), 10, "each from 1 to");
    assert_at(&lengths("[99999999999]"), 10, "each from 1 to");
    // Vacuous settings by a server's rules: `lengths` that no scenario reads, a concurrent
    // schedule with one request, parity's pool budget. The step-level rules do not apply:
    // `prefix` with 3 tokens tests a server's prompt cache (no while-running case here).
    let with = |settings: &str, scenarios: &str| {
        openai("a = []")
            .replace("tile = 16", &format!("tile = 16\n{settings}"))
            .replace("name = \"t\"\n", &format!("name = \"t\"\nscenarios = [{scenarios}]\n"))
    };
    assert_at(&with("lengths = [15]", "\"single\""), 11, "settings.lengths has no effect");
    assert_at(&with("concurrent = { requests = 1 }", "\"concurrent\""), 11, "tests no concurrency");
    assert_at(&with("pool_blocks = 8", "\"single\""), 11, "a server keeps its own KV cache");
    assert!(parity::parse_suite(Path::new("suites/x.toml"), &with("max_tokens = 3", "\"prefix\"")).is_ok());
}

#[test]
fn sizes_have_an_upper_bound() {
    assert_at(&GOOD.replace("tile = 16", "tile = 16\nmax_tokens = 1000000000000"), 5, "larger than the limit");
    assert_at(
        &GOOD.replace("tile = 16", "tile = 16\nconcurrent = { arrivals = [0, 99999999999] }"),
        5,
        "each from 0 to",
    );
}

// ---- issue #14: settings that make a scenario test nothing -----------------------------------

/// Was: `lookahead = 0` made rollback roll back nothing, and the suite passed.
#[test]
fn lookahead_zero_with_rollback_is_rejected_at_lookahead() {
    assert_at(
        &GOOD.replace("tile = 16", "tile = 16\nlookahead = 0"),
        5,
        "settings.lookahead = 0: `rollback` decodes no draft rows",
    );
    // Without the rollback scenario it is harmless.
    let text = GOOD
        .replace("name = \"t\"", "name = \"t\"\nscenarios = [\"single\"]")
        .replace("tile = 16", "tile = 16\nlookahead = 0");
    assert!(parity::parse_suite(Path::new("suites/x.toml"), &text).is_ok());
}

#[test]
fn rollback_every_at_or_past_max_tokens_is_rejected() {
    let text = GOOD.replace("tile = 16", "tile = 16\nmax_tokens = 8\nrollback_every = 8");
    assert_at(&text, 6, "settings.rollback_every = 8 with max_tokens = 8: no rollback happens");
    // With rollback_every left at its default, the blame goes to what the suite wrote.
    assert_at(&GOOD.replace("tile = 16", "tile = 16\nmax_tokens = 4"), 5, "rollback_every = 5 with max_tokens = 4");
}

#[test]
fn concurrent_settings_that_never_batch_are_rejected() {
    let c = |s: &str| GOOD.replace("tile = 16", &format!("tile = 16\n[settings.concurrent]\n{s}"));
    assert_at(&c("max_batch = 1"), 6, "no two requests are ever decoded together");
    assert_at(&c("requests = 1"), 6, "no two requests are ever decoded together");
    // Each request arrives after the previous one has finished (16 steps each).
    assert_at(&c("requests = 2\narrivals = [0, 40]"), 7, "arrivals [0, 40]");
    assert!(parity::parse_suite(Path::new("suites/x.toml"), &c("requests = 2\narrivals = [0, 3]")).is_ok());
}

#[test]
fn max_tokens_too_small_for_decode_and_prefix_scenarios() {
    let one = GOOD
        .replace("name = \"t\"", "name = \"t\"\nscenarios = [\"single\", \"batch2\"]")
        .replace("tile = 16", "tile = 16\nmax_tokens = 1");
    assert_at(&one, 6, "max_tokens = 1: no decode step runs, so `batch2` tests nothing");
    let three = GOOD
        .replace("name = \"t\"", "name = \"t\"\nscenarios = [\"prefix\"]")
        .replace("tile = 16", "tile = 16\nmax_tokens = 3");
    assert_at(&three, 6, "`prefix` while-running decodes the donor 2 steps before the adopter joins");
}

#[test]
fn pool_blocks_without_a_paged_backend_or_too_small_is_rejected() {
    let dense = GOOD
        .replace("name = \"t\"", "name = \"t\"\nbackends = [\"dense\"]")
        .replace("tile = 16", "tile = 16\npool_blocks = 8");
    assert_at(&dense, 6, "settings.pool_blocks = 8 has no effect: no paged backend runs");
    assert_at(&GOOD.replace("tile = 16", "tile = 16\nblock_size = 4\npool_blocks = 2"), 6, "cannot hold one sequence");
}

/// With every prompt's length fixed in the suite, prompt-dependent facts are caught early.
#[test]
fn known_prompt_lengths_catch_chunk_and_block_sizes_that_no_prompt_crosses() {
    let fixed = GOOD.replace("text = \"hello\"", "text = \"hello\"\nlength = 12");
    assert_at(
        &fixed.replace("tile = 16", "tile = 16\nchunk = 12"),
        5,
        "settings.chunk = 12 is at least every prompt's length",
    );
    let big = fixed.replace("tile = 16", "tile = 16\nblock_size = 64");
    assert_at(&big, 5, "settings.block_size = 64: no sequence crosses a block boundary (the longest writes 39 rows)");
    assert!(parity::parse_suite(Path::new("suites/x.toml"), &fixed).is_ok());
}

/// Every shipped suite parses under the current rules (names, bounds, vacuous settings by its
/// engine's kind): a rule added later cannot silently break a suite nobody re-ran.
#[test]
fn every_shipped_suite_parses() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("suites");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).expect("suites/") {
        let path = entry.expect("entry").path();
        let name = path.file_name().and_then(|f| f.to_str()).unwrap_or_default();
        // Scratch suites the tests write (`.test-*.toml`) are not shipped.
        if name.starts_with('.') || path.extension().is_none_or(|e| e != "toml") {
            continue;
        }
        parity::load_suite(&path).unwrap_or_else(|e| panic!("{e}"));
        n += 1;
    }
    assert!(n >= 6, "only {n} suites found in {}", dir.display());
}

// ---- pinned scripts ([[scripts]]) ----------------------------------------------------------

/// GOOD (ending in its checkpoint) with `extra` in front of the `[[checkpoints]]` table.
fn with(extra: &str) -> String {
    GOOD.replace("[[checkpoints]]", &format!("{extra}\n[[checkpoints]]"))
}

#[test]
fn a_pinned_script_runs_by_default_and_its_mistakes_are_located() {
    let s = parity::parse_suite(
        Path::new("suites/x.toml"),
        &with("[[scripts]]\nname = \"s1\"\nops = \"a = p[:3]; prefill a 3\""),
    )
    .unwrap();
    assert_eq!(s.scripts.len(), 1);
    assert!(s.checkpoints[0].scenarios.contains(&parity::vocab::Scenario::Script), "{:?}", s.checkpoints[0].scenarios);
    let script = |ops: &str| with(&format!("[[scripts]]\nname = \"s1\"\nops = \"{ops}\""));
    let at = GOOD.lines().position(|l| l == "[[checkpoints]]").unwrap() + 3;
    assert_at(&script("a = nope; step a"), at, "unknown prompt `nope`");
    assert_at(&script("a = p; prefill a 0"), at, "operation 2 `prefill a 0`: rows: must be positive");
    assert_at(&script("step a"), at, "creates no sequence");
    assert_at(&with("[[scripts]]\nname = \"../x\"\nops = \"a = p\""), at - 1, "script name");
    let twice = with("[[scripts]]\nname = \"s\"\nops = \"a = p\"\n[[scripts]]\nname = \"s\"\nops = \"a = p\"");
    assert!(err(&twice).message.contains("defined twice"), "{}", err(&twice));
}

#[test]
fn the_script_scenario_without_scripts_tests_nothing() {
    let text = GOOD.replace("name = \"t\"", "name = \"t\"\nscenarios = [\"single\", \"script\"]");
    assert_at(&text, 3, "scenario `script` runs the suite's [[scripts]], and it has none");
}

// ---- evidence ([engine.witness.PATH], tolerance.vacuous) --------------------------------------

/// A witness names a path, claims and requirements parity knows, says why it waives, and
/// reads counters only from a server with a metrics endpoint: each mistake at its place.
#[test]
fn witness_mistakes_are_located() {
    let witness = |table: &str| with(&format!("[engine]\nkind = \"builtin\"\n{table}"));
    let at = GOOD.lines().position(|l| l == "[[checkpoints]]").unwrap() + 3;
    let s = parity::parse_suite(
        Path::new("suites/x.toml"),
        &witness("[engine.witness.paged]\nwaive = { non-adjacent = \"the pool hands out any free block\" }\nrequire = [\"counters\"]"),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let w = &s.checkpoints[0].witness["paged"];
    assert_eq!(w.waive["non-adjacent"], "the pool hands out any free block");
    assert_eq!(w.require, vec!["counters".to_string()]);
    assert_at(
        &witness("[engine.witness.pagd]\nrequire = [\"counters\"]"),
        at,
        "engine.witness.pagd: not a path of this engine",
    );
    assert_at(&witness("[engine.witness.paged]\nwaive = { batchd = \"x\" }"), at + 1, "unknown claim `batchd`");
    assert_at(
        &witness("[engine.witness.paged]\nwaive = { batched = \"\" }"),
        at + 1,
        "say why the path does not show it",
    );
    assert_at(&witness("[engine.witness.paged]\nrequire = [\"count\"]"), at + 1, "unknown evidence `count`");
    assert_at(&witness("[engine.witness.paged]\nmoves = [\"x_total\"]"), at + 1, "set engine.metrics");
}

#[test]
fn tolerance_vacuous_lets_vacuous_rows_pass() {
    use parity::vocab::Verdict;
    let allowed = |tolerance: &str| {
        let s = parity::parse_suite(Path::new("suites/x.toml"), &with(&format!("[tolerance]\n{tolerance}")))
            .unwrap_or_else(|e| panic!("{e}"));
        s.checkpoints[0].tolerance.allow.clone()
    };
    assert!(!allowed("strict = false").contains(&Verdict::Vacuous));
    assert!(allowed("vacuous = true").contains(&Verdict::Vacuous));
    assert_eq!(allowed("vacuous = true\nstrict = true"), vec![Verdict::Identical, Verdict::Vacuous]);
    assert_at(
        &with("[tolerance]\nvacuous = 1"),
        GOOD.lines().position(|l| l == "[[checkpoints]]").unwrap() + 2,
        "invalid type",
    );
}

/// `engine.model` is the engine's own model file for engines that load one (process,
/// openai); the builtin runs the checkpoint itself, so there it is a mistake at its place.
#[test]
fn an_engine_model_file_is_for_engines_that_load_one() {
    let at = GOOD.lines().position(|l| l == "[[checkpoints]]").unwrap() + 3;
    let s = parity::parse_suite(
        Path::new("suites/x.toml"),
        &with("[engine]\nkind = \"process\"\ncommand = [\"adapter\", \"{model}\"]\nmodel = \"${NO_SUCH_VAR:-m.gguf}\"\n[engine.paths]\na = []"),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    match &s.checkpoints[0].engine {
        parity::vocab::EngineSpec::Process(p) => assert_eq!(p.model.as_deref(), Some("m.gguf")),
        other => panic!("{other:?}"),
    }
    assert_at(&with("[engine]\nkind = \"builtin\"\nmodel = \"m.gguf\""), at, "the builtin runs the checkpoint itself");
}

/// `no_snapshot` takes the reason a reader of the run will see; an empty one is refused where
/// it is written, and a given one reaches the checkpoint trimmed.
#[test]
fn no_snapshot_needs_a_reason() {
    let with = |why: &str| {
        GOOD.replace(
            "path = \"../fixtures/llama-tiny.toml\"",
            &format!("path = \"../fixtures/llama-tiny.toml\"\nno_snapshot = \"{why}\""),
        )
    };
    assert_at(&with("  "), 10, "no_snapshot: say why");
    let s = parity::parse_suite(Path::new("suites/x.toml"), &with(" rows follow request timing ")).expect("parses");
    assert_eq!(s.checkpoints[0].no_snapshot.as_deref(), Some("rows follow request timing"));
    assert_eq!(parity::parse_suite(Path::new("suites/x.toml"), GOOD).expect("parses").checkpoints[0].no_snapshot, None);
}
