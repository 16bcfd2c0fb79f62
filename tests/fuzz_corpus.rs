//! The fuzz corpus and every committed crasher, replayed through the same harnesses
//! `cargo fuzz` runs (parity::fuzzing), on stable: a crash found once by `ci/fuzz` stays a
//! regression test here. Each file under fuzz/regressions/<target>/ is named after the
//! failure it caught.

use std::path::{Path, PathBuf};

fn files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| rd.flatten().map(|e| e.path()).filter(|p| p.is_file()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

fn replay(target: &str, harness: fn(&[u8])) -> usize {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let mut n = 0;
    for kind in ["corpus", "regressions"] {
        for f in files(&root.join(kind).join(target)) {
            let data = std::fs::read(&f).expect("read");
            // A panic names the input that caused it.
            let outcome = std::panic::catch_unwind(|| harness(&data));
            assert!(outcome.is_ok(), "{} panics in the {target} harness", f.display());
            n += 1;
        }
    }
    n
}

#[test]
fn suite_corpus_and_crashers_replay_clean() {
    assert!(replay("suite", parity::fuzzing::suite) >= 4);
}

#[test]
fn config_corpus_and_crashers_replay_clean() {
    assert!(replay("config", parity::fuzzing::config) >= 1);
}

#[test]
fn safetensors_header_corpus_and_crashers_replay_clean() {
    assert!(replay("safetensors_header", parity::fuzzing::safetensors_header) >= 5);
}
