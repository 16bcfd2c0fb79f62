//! Every suite mistake is reported with file, line and column before anything runs.

use std::path::Path;

use parity::suite;

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

fn err(text: &str) -> suite::SuiteError {
    suite::parse(Path::new("suites/x.toml"), text).expect_err("suite should be rejected")
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
    let s = suite::parse(Path::new("suites/x.toml"), GOOD).unwrap();
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
        "exactly one of text, chat or ids",
    );
}

#[test]
fn unknown_dtype_and_backend() {
    assert_at(&GOOD.replace("name = \"t\"", "name = \"t\"\ndtype = \"float8\""), 3, "unknown dtype `float8`");
    assert_at(
        &GOOD.replace("name = \"t\"", "name = \"t\"\nbackends = [\"sparse\"]"),
        3,
        "unknown path `sparse`; this engine has dense, paged",
    );
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
    let s = suite::parse(Path::new("suites/x.toml"), &good).unwrap();
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
    let s = suite::parse(Path::new("suites/x.toml"), &process("reference = \"builtin:dense\"", "a = []")).unwrap();
    assert!(s.checkpoints[0].engine.needs_builtin());
}

#[test]
fn missing_prompts_or_checkpoints() {
    assert!(err("name = \"t\"\n").message.contains("needs at least one prompt"));
}

#[test]
fn env_expansion_in_paths() {
    assert_eq!(suite::expand_env("${PARITY_TEST_SURELY_UNSET:-a/b}/c").unwrap(), "a/b/c");
    assert!(suite::expand_env("${PARITY_TEST_SURELY_UNSET}").unwrap_err().contains("not set"));
}
