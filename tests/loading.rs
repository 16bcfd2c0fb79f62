//! Bad input never panics: every case is an error that names the file and the field.

use crate::common;

use std::path::Path;

use parity::Error;
use parity::checkpoint::{self, ModelConfig};
use parity::dtype::DtypeName;
use parity::faults::Faults;
use parity::generate;
use parity::kv::{DenseCache, PagedBlockPool, PoolOptions};
use parity::model::Model;

fn load_err(dir: &Path) -> String {
    let result = ModelConfig::load(dir).and_then(|c| Model::load(dir, c, Some(DtypeName::Float32), false));
    match result {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => e.to_string(),
    }
}

use crate::common::edit_config;

#[test]
fn fixtures_of_every_family_load_and_generate() {
    for name in ["llama-tiny", "qwen3-tiny", "llama-tiny-8bit"] {
        let dir = common::fixture(name);
        let (model, tok) = common::load(&dir);
        let prompt = tok.encode_chat("hello").unwrap();
        let mut kv = DenseCache::new(model.kv_shape());
        let (_, trace) = generate(&model, &mut kv, &prompt, 4).unwrap();
        assert_eq!(trace.tokens.len(), 4, "{name}");
        assert_eq!(trace.logits[0].shape(), &[model.config.vocab_size as i32], "{name}");
    }
}

#[test]
fn fixture_generation_is_deterministic() {
    let a = std::fs::read(common::fixture("qwen3-tiny").join("model.safetensors")).unwrap();
    let spec = std::fs::read_to_string(common::repo().join("fixtures/qwen3-tiny.toml")).unwrap();
    let copy = common::scratch("fixture-determinism").join("again.toml");
    std::fs::write(&copy, spec).unwrap();
    let dir = checkpoint::resolve(copy.to_str().unwrap(), Path::new("/")).unwrap();
    let b = std::fs::read(dir.join("model.safetensors")).unwrap();
    assert!(a == b, "two generations of the same spec differ");
}

#[test]
fn malformed_config_json_names_the_file() {
    let dir = common::copy_checkpoint(&common::fixture("llama-tiny"), "bad-json");
    std::fs::write(dir.join("config.json"), "{ \"model_type\": \"llama\", ").unwrap();
    let e = load_err(&dir);
    assert!(e.contains("config.json") && e.contains("not valid JSON"), "{e}");
}

#[test]
fn unknown_model_type_lists_the_supported_ones() {
    let dir = common::copy_checkpoint(&common::fixture("llama-tiny"), "bad-type");
    edit_config(&dir, |v| v["model_type"] = "mamba".into());
    let e = load_err(&dir);
    assert!(e.contains("config.json") && e.contains("model_type") && e.contains("mamba"), "{e}");
    assert!(e.contains("llama, qwen3"), "{e}");
}

#[test]
fn missing_and_mistyped_fields_are_named() {
    let dir = common::copy_checkpoint(&common::fixture("llama-tiny"), "missing-field");
    edit_config(&dir, |v| {
        v.as_object_mut().unwrap().remove("num_attention_heads");
    });
    let e = load_err(&dir);
    assert!(e.contains("`num_attention_heads`: missing"), "{e}");

    edit_config(&dir, |v| {
        v["num_attention_heads"] = "four".into();
    });
    let e = load_err(&dir);
    assert!(e.contains("`num_attention_heads`") && e.contains("positive integer"), "{e}");

    edit_config(&dir, |v| {
        v["num_attention_heads"] = 4.into();
        v["num_key_value_heads"] = 3.into();
    });
    let e = load_err(&dir);
    assert!(e.contains("`num_key_value_heads`") && e.contains("does not divide"), "{e}");
}

#[test]
fn missing_safetensors_is_an_error_naming_the_directory() {
    let dir = common::copy_checkpoint(&common::fixture("llama-tiny"), "no-weights");
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let e = load_err(&dir);
    assert!(e.contains("no model.safetensors"), "{e}");
}

#[test]
fn truncated_safetensors_is_an_error_naming_the_file() {
    let dir = common::copy_checkpoint(&common::fixture("qwen3-tiny"), "truncated");
    let file = dir.join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    for keep in [4, 100, bytes.len() / 2, bytes.len() - 1] {
        std::fs::write(&file, &bytes[..keep]).unwrap();
        let e = load_err(&dir);
        assert!(e.contains("model.safetensors") && e.contains("truncated or corrupt"), "keep {keep}: {e}");
    }
}

#[test]
fn shard_index_pointing_at_a_missing_shard_is_an_error() {
    let dir = common::copy_checkpoint(&common::fixture("llama-tiny"), "bad-index");
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        r#"{"metadata": {}, "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
    let e = load_err(&dir);
    assert!(e.contains("model.safetensors.index.json") && e.contains("model-00002-of-00002.safetensors"), "{e}");
}

#[test]
fn wrong_shapes_name_the_tensor_and_both_shapes() {
    // The config claims a larger model than the file holds.
    let dir = common::copy_checkpoint(&common::fixture("llama-tiny"), "wrong-shape");
    edit_config(&dir, |v| v["intermediate_size"] = 256.into());
    let e = load_err(&dir);
    assert!(
        e.contains("model.layers.0.mlp.gate_proj.weight") && e.contains("[128, 64]") && e.contains("[256, 64]"),
        "{e}"
    );

    // Quantization settings that disagree with the packed tensors.
    let dir = common::copy_checkpoint(&common::fixture("qwen3-tiny"), "wrong-bits");
    edit_config(&dir, |v| v["quantization"]["bits"] = 8.into());
    let e = load_err(&dir);
    assert!(e.contains("model.embed_tokens.weight") && e.contains("shape"), "{e}");
}

#[test]
fn missing_tensor_is_named() {
    let dir = common::copy_checkpoint(&common::fixture("llama-tiny"), "missing-tensor");
    edit_config(&dir, |v| v["num_hidden_layers"] = 3.into());
    let e = load_err(&dir);
    assert!(e.contains("model.layers.2.") && e.contains("missing"), "{e}");
}

#[test]
fn unknown_repo_id_says_where_it_looked_and_how_to_fetch() {
    let cache = common::scratch("hf-cache-empty");
    let e = checkpoint::resolve_in("mlx-community/Qwen3-0.6B-4bit", Path::new("."), Some(cache)).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::CheckpointNotFound { .. }));
    assert!(msg.contains("models--mlx-community--Qwen3-0.6B-4bit"), "{msg}");
    assert!(msg.contains("huggingface-cli download mlx-community/Qwen3-0.6B-4bit"), "{msg}");
}

#[test]
fn hf_cache_location_follows_huggingface_hub_precedence() {
    use std::ffi::OsString;
    let env = |pairs: &'static [(&'static str, &'static str)]| {
        move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| OsString::from(v))
    };
    let dir = checkpoint::hf_cache_dir_from;
    assert_eq!(dir(env(&[("HF_HUB_CACHE", "/a"), ("HF_HOME", "/b"), ("HOME", "/h")])), Some("/a".into()));
    assert_eq!(dir(env(&[("HF_HOME", "/b"), ("HOME", "/h")])), Some("/b/hub".into()));
    assert_eq!(dir(env(&[("HF_HUB_CACHE", ""), ("HOME", "/h")])), Some("/h/.cache/huggingface/hub".into()));
}

#[test]
fn repo_id_resolves_offline_in_the_hf_cache() {
    let cache = common::scratch("hf-cache");
    let repo = cache.join("models--tiny-org--llama-tiny");
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::create_dir_all(repo.join("snapshots")).unwrap();
    std::fs::write(repo.join("refs").join("main"), "abc123\n").unwrap();
    let src = common::copy_checkpoint(&common::fixture("llama-tiny"), "hf-snapshot-src");
    let snap = repo.join("snapshots").join("abc123");
    std::fs::rename(&src, &snap).unwrap();
    let dir = checkpoint::resolve_in("tiny-org/llama-tiny", Path::new("."), Some(cache)).unwrap();
    assert_eq!(dir, snap);
    let (model, _) = common::load(&dir);
    assert_eq!(model.config.num_layers, 2);
}

#[test]
fn prompt_longer_than_the_context_is_an_error() {
    let dir = common::copy_checkpoint(&common::fixture("llama-tiny"), "short-context");
    edit_config(&dir, |v| v["max_position_embeddings"] = 16.into());
    let (model, _) = common::load(&dir);
    let mut kv = DenseCache::new(model.kv_shape());
    let err = generate(&model, &mut kv, &[65; 20], 4).unwrap_err();
    assert!(matches!(err, Error::ContextOverflow { held: 0, adding: 20, context: 16 }), "{err}");
    // Decode past the context stops with the same error, not a panic.
    let mut kv = DenseCache::new(model.kv_shape());
    let err = generate(&model, &mut kv, &[65; 10], 10).unwrap_err();
    assert!(err.to_string().contains("exceeds the context of 16"), "{err}");
}

#[test]
fn exhausted_pool_is_an_error() {
    let (model, _) = common::load(&common::fixture("llama-tiny"));
    let opts = PoolOptions { block_size: 4, initial_blocks: 2, max_blocks: Some(3), poison: false };
    let mut kv = PagedBlockPool::new(model.kv_shape(), opts, Faults::NONE).unwrap();
    let err = generate(&model, &mut kv, &[65; 10], 8).unwrap_err();
    assert!(matches!(err, Error::PoolExhausted { budget: 3, .. }), "{err}");
}
