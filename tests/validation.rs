//! Issue #14, items 2-4: broken checkpoints are refused by `inspect` as by `generate` and `run`
//! (one validation, every problem listed by tensor), non-finite weights are blamed on the
//! checkpoint rather than on the KV pool, and an empty prompt says what the user did.

use crate::common;

use std::path::Path;
use std::process::{Command, Output};

fn parity(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_parity"))
        .current_dir(common::repo())
        .env("PARITY_DEVICE", "cpu")
        .args(args)
        .output()
        .expect("run parity")
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn inspect(dir: &Path) -> (i32, String) {
    let o = parity(&["inspect", dir.to_str().expect("utf-8")]);
    (o.status.code().unwrap_or(-1), text(&o))
}

fn generate(dir: &Path, prompt: &str) -> (i32, String) {
    let o = parity(&["generate", dir.to_str().expect("utf-8"), "--prompt", prompt, "--max-tokens", "3"]);
    (o.status.code().unwrap_or(-1), text(&o))
}

/// Inspect and generate agree: inspect exits 1 listing `needles`, generate refuses too.
fn refused_by_both(dir: &Path, needles: &[&str]) {
    let (code, out) = inspect(dir);
    assert_eq!(code, 1, "inspect must fail: {out}");
    for n in needles {
        assert!(out.contains(n), "inspect should mention `{n}`:\n{out}");
    }
    let (code, out) = generate(dir, "hi");
    assert_ne!(code, 0, "generate must refuse what inspect refuses: {out}");
    assert!(!out.contains("panicked"), "{out}");
}

#[test]
fn a_valid_fixture_inspects_clean() {
    for name in ["llama-tiny", "qwen3-tiny", "llama-tiny-8bit"] {
        let (code, out) = inspect(&common::fixture(name));
        assert_eq!(code, 0, "{name}: {out}");
        assert!(out.contains("valid        every tensor"), "{name}: {out}");
    }
}

/// Was: inspect printed its summary and exited 0 on a checkpoint missing a tensor.
#[test]
fn a_missing_tensor_is_listed_by_name() {
    let dir = common::copy_checkpoint(&common::fixture("llama-tiny"), "val-missing");
    common::rewrite_tensors(&dir, |n, d, s, b| (n != "model.layers.1.self_attn.k_proj.weight").then_some((d, s, b)));
    refused_by_both(&dir, &["problems     1", "tensor `model.layers.1.self_attn.k_proj.weight`: missing"]);
}

/// Was: a wrong hidden_size passed inspect; now every tensor it breaks is listed at once.
#[test]
fn a_wrong_hidden_size_lists_every_tensor_it_breaks() {
    let dir = common::copy_checkpoint(&common::fixture("llama-tiny"), "val-hidden");
    common::edit_config(&dir, |v| v["hidden_size"] = 128.into());
    refused_by_both(
        &dir,
        &["model.embed_tokens.weight`: shape [320, 64], expected [320, 128]", "model.norm.weight", "lm_head.weight"],
    );
    let (_, out) = inspect(&dir);
    let count = out.lines().filter(|l| l.starts_with("  - tensor")).count();
    assert!(count > 10, "one pass finds all of them, not the first: {count}\n{out}");
}

/// Was: bits the file does not hold (3 on a 4-bit file) passed inspect.
#[test]
fn quantization_bits_that_do_not_match_the_file_are_listed() {
    let dir = common::copy_checkpoint(&common::fixture("qwen3-tiny"), "val-bits");
    common::edit_config(&dir, |v| v["quantization"]["bits"] = 3.into());
    refused_by_both(&dir, &["model.embed_tokens.weight`: shape [320, 8], expected [320, 6]"]);
    // Bits MLX does not support at all: a config.json problem, still exit 1 from inspect.
    common::edit_config(&dir, |v| v["quantization"]["bits"] = 7.into());
    refused_by_both(&dir, &["quantization.bits", "unsupported 7"]);
}

/// Was: a group size that does not divide the input features passed inspect (and `groups`
/// was computed with a floor division).
#[test]
fn a_group_size_that_does_not_divide_the_rows_is_a_layout_problem() {
    let dir = common::copy_checkpoint(&common::fixture("qwen3-tiny"), "val-group");
    common::edit_config(&dir, |v| v["quantization"]["group_size"] = 128.into());
    refused_by_both(&dir, &["self_attn.q_proj.weight`: 64 input features are not a multiple of group_size 128"]);
}

/// Was: an absurd vocabulary passed inspect (and wrapped to a negative int32 in the shape check).
#[test]
fn an_absurd_vocabulary_is_refused() {
    let dir = common::copy_checkpoint(&common::fixture("llama-tiny"), "val-vocab");
    common::edit_config(&dir, |v| v["vocab_size"] = 5_000_000_000u64.into());
    refused_by_both(&dir, &["`vocab_size`: 5000000000 is larger than any tensor dimension MLX can hold"]);
    common::edit_config(&dir, |v| v["vocab_size"] = 1_000_000_000u64.into());
    refused_by_both(&dir, &["model.embed_tokens.weight`: shape [320, 64], expected [1000000000, 64]"]);
    // Fewer rows than the tokenizer has tokens: ids past the table cannot be embedded.
    common::edit_config(&dir, |v| v["vocab_size"] = 200.into());
    let (code, out) = inspect(&dir);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("tokenizer: 259 tokens, but config.json `vocab_size` is 200"), "{out}");
    assert!(out.contains("shape [320, 64], expected [200, 64]"), "{out}");
}

/// A wrong dtype (float where packed uint32 is expected) is named with both dtypes.
#[test]
fn a_wrong_dtype_is_named() {
    let dir = common::copy_checkpoint(&common::fixture("qwen3-tiny"), "val-dtype");
    common::rewrite_tensors(&dir, |n, d, s, b| {
        if n == "model.layers.0.mlp.up_proj.weight" { Some((safetensors::Dtype::I32, s, b)) } else { Some((d, s, b)) }
    });
    refused_by_both(&dir, &["model.layers.0.mlp.up_proj.weight`: dtype int32, expected uint32"]);
}

fn nan_checkpoint(name: &str) -> std::path::PathBuf {
    let dir = common::copy_checkpoint(&common::fixture("llama-tiny"), name);
    common::rewrite_tensors(&dir, |n, d, s, b| {
        if n == "model.layers.0.post_attention_layernorm.weight" {
            Some((d, s, f32::NAN.to_le_bytes().repeat(b.len() / 4)))
        } else {
            Some((d, s, b))
        }
    });
    dir
}

/// Was: `generate` printed garbage from NaN logits and exited 0.
#[test]
fn non_finite_weights_fail_generate_and_inspect_blaming_the_checkpoint() {
    let dir = nan_checkpoint("val-nan");
    let (code, out) = generate(&dir, "hello");
    assert_ne!(code, 0, "{out}");
    assert!(out.contains("logits are not finite at step 0: the checkpoint or the runtime produces NaN/inf"), "{out}");
    let (code, out) = inspect(&dir);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("model.layers.0.post_attention_layernorm.weight`: 64 of 64 values are NaN"), "{out}");
}

/// Was: every row said "NaN logits (a poisoned or freed row was read)", sending an engineer
/// to the KV pool for a checkpoint problem.
#[test]
fn a_non_finite_reference_is_a_checkpoint_error_on_every_row() {
    let dir = nan_checkpoint("val-nan-run");
    let suite = dir.parent().expect("scratch").join("nan-suite.toml");
    std::fs::write(
        &suite,
        format!(
            "name = \"nan\"\nscenarios = [\"single\", \"batch2\"]\n[settings]\nmax_tokens = 4\n\
             [[prompts]]\nname = \"p\"\ntext = \"hello there\"\n[[checkpoints]]\nname = \"nan\"\npath = \"{}\"\n",
            dir.display()
        ),
    )
    .expect("suite");
    let json = dir.join("r.json");
    let o = parity(&["run", suite.to_str().expect("utf-8"), "--no-snapshots", "--json", json.to_str().expect("utf-8")]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).expect("json")).expect("report");
    let rows = r["rows"].as_array().expect("rows");
    // A case the suite cannot form (batch2 ragged with one prompt) is a skipped row that
    // computed nothing, so it has no reference to blame; every row that ran must blame it.
    let ran: Vec<&serde_json::Value> = rows.iter().filter(|r| r["verdict"] != "skipped").collect();
    assert!(!ran.is_empty());
    for row in ran {
        let f = row["failure"].as_str().unwrap_or_default();
        assert!(f.contains("reference logits are not finite at step 0: the checkpoint or the runtime"), "{row}");
        assert!(!f.contains("poisoned"), "{row}");
    }
}

/// Was: "every row of a step needs the same, non-zero number of tokens".
#[test]
fn an_empty_prompt_says_it_encodes_to_zero_tokens() {
    let (code, out) = generate(&common::fixture("llama-tiny"), "");
    assert_ne!(code, 0, "{out}");
    assert!(out.contains("the prompt \"\" encodes to zero tokens"), "{out}");
    assert!(!out.contains("every row of a step"), "{out}");
}

/// A shard index cannot send the loader outside the checkpoint directory.
#[test]
fn a_shard_index_naming_a_path_outside_the_directory_is_refused() {
    let dir = common::copy_checkpoint(&common::fixture("llama-tiny"), "val-shard-escape");
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        r#"{"weight_map": {"model.norm.weight": "../val-missing/model.safetensors"}}"#,
    )
    .expect("index");
    let (code, out) = inspect(&dir);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("is not a file name in this directory"), "{out}");
}
