//! Shared test helpers: where the fixtures and the shared checkpoint are.
#![allow(dead_code)]

use std::path::PathBuf;

use parity::checkpoint::{self, ModelConfig, Tokenizer};
use parity::dtype::DtypeName;
use parity::model::Model;

/// Pin MLX to the CPU for this test process, once, before any array exists. The accepted
/// snapshots and the mlx-lm references are CPU float32 results; on a Mac the default device is
/// the GPU, whose arithmetic differs, so unpinned tests would fail there for no bug.
pub fn cpu() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        parity::use_device(parity::DeviceChoice::Cpu).expect("the CPU device is always available");
    });
}

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The read-only directory with the real checkpoint and references: `PARITY_SHARED`, else
/// `../shared` next to the repository (where CI has it).
pub fn shared() -> PathBuf {
    let dir = std::env::var_os("PARITY_SHARED").map(PathBuf::from).unwrap_or_else(|| repo().join("..").join("shared"));
    assert!(dir.join("checkpoints").is_dir(), "shared test data not found at {} (set PARITY_SHARED)", dir.display());
    dir
}

pub fn smollm2() -> PathBuf {
    cpu();
    shared().join("checkpoints").join("smollm2-135m-instruct-4bit")
}

/// Generate (once) and return the directory of fixture `name` (fixtures/<name>.toml).
pub fn fixture(name: &str) -> PathBuf {
    cpu();
    let spec = repo().join("fixtures").join(format!("{name}.toml"));
    checkpoint::resolve(spec.to_str().expect("utf-8 path"), &repo()).expect("fixture")
}

pub fn load(dir: &std::path::Path) -> (Model, Tokenizer) {
    cpu();
    let config = ModelConfig::load(dir).expect("config");
    let model = Model::load(dir, config, Some(DtypeName::Float32), false).expect("model");
    (model, Tokenizer::load(dir).expect("tokenizer"))
}

/// A scratch directory under target/, fresh per call.
pub fn scratch(name: &str) -> PathBuf {
    let dir = repo().join("target").join("test-scratch").join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// Copy a checkpoint directory (files only) so a test can break one file.
pub fn copy_checkpoint(src: &std::path::Path, name: &str) -> PathBuf {
    let dst = scratch(name);
    for entry in std::fs::read_dir(src).expect("read dir") {
        let p = entry.expect("entry").path();
        if p.is_file() {
            std::fs::copy(&p, dst.join(p.file_name().expect("name"))).expect("copy");
        }
    }
    dst
}

/// The processes whose command line carries `tag` (leftover adapters or servers of one test).
pub fn processes_tagged(tag: &str) -> Vec<String> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let zombie = stat.rsplit(')').next().is_some_and(|s| s.trim_start().starts_with('Z'));
        if cmdline.contains(tag) && !zombie {
            out.push(cmdline);
        }
    }
    out
}

/// Nothing started with `tag` on its command line is still running (after a short grace).
pub fn assert_no_leftovers(tag: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !processes_tagged(tag).is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let left = processes_tagged(tag);
    assert!(left.is_empty(), "engine processes outlived the run: {left:?}");
}

/// The binary as the tests run it: on the CPU (the accepted snapshots are CPU ones, also on a
/// Mac), never accepting snapshots because of the caller's environment.
pub fn command() -> std::process::Command {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_parity"));
    c.current_dir(repo()).env("PARITY_DEVICE", "cpu").env_remove("PARITY_UPDATE").env_remove("INSTA_UPDATE");
    c
}

pub fn parity(args: &[&str]) -> std::process::Output {
    command().args(args).output().expect("run parity")
}

/// `parity run` with `args` and `--no-snapshots --json`, into a scratch file named after
/// `scratch`: its exit code, its output and the report it wrote.
pub fn run_report(scratch: &str, args: &[&str]) -> (i32, String, parity::report::Report) {
    let json = self::scratch(scratch).join("r.json");
    let o = command().arg("run").args(args).args(["--no-snapshots", "--json"]).arg(&json).output().expect("run parity");
    let report = std::fs::read_to_string(&json)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_else(|| panic!("no report from parity run {args:?}: {}", text(&o)));
    (code(&o), text(&o), report)
}

pub fn code(o: &std::process::Output) -> i32 {
    o.status.code().unwrap_or(-1)
}

pub fn text(o: &std::process::Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// Edit a checkpoint's config.json in place.
pub fn edit_config(dir: &std::path::Path, f: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("config")).expect("json");
    f(&mut v);
    std::fs::write(&path, v.to_string()).expect("write config");
}

/// Rewrite a checkpoint's model.safetensors: `f` sees each tensor (name, dtype, shape, bytes)
/// and returns the tensor to keep, changed or not, or `None` to drop it.
pub fn rewrite_tensors(
    dir: &std::path::Path,
    mut f: impl FnMut(&str, safetensors::Dtype, Vec<usize>, Vec<u8>) -> Option<(safetensors::Dtype, Vec<usize>, Vec<u8>)>,
) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).expect("read weights");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("valid fixture");
    let mut kept: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in st.tensors() {
        if let Some((d, s, b)) = f(&name, view.dtype(), view.shape().to_vec(), view.data().to_vec()) {
            kept.push((name, d, s, b));
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = kept
        .iter()
        .map(|(n, d, s, b)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).expect("view")))
        .collect();
    std::fs::write(&path, safetensors::tensor::serialize(views, None).expect("serialize")).expect("write weights");
}
