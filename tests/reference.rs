//! The dense path reproduces mlx-lm (Python, same MLX, float32) token for token on the real
//! SmolLM2 checkpoint; the paged path reproduces it too, at two block sizes.

use crate::common;

use parity::faults::Faults;
use parity::generate;
use parity::kv::{DenseCache, KvCache, PagedBlockPool, PoolOptions};
use serde_json::Value;

fn cases() -> Vec<(String, Vec<u32>, Vec<u32>)> {
    let path = common::shared().join("reference").join("smollm2-4bit-f32-mlx-lm.json");
    let text = std::fs::read_to_string(&path).expect("reference file");
    let v: Value = serde_json::from_str(&text).expect("reference json");
    assert_eq!(v["dtype"], "float32");
    let ids = |x: &Value| x.as_array().expect("ids").iter().map(|i| i.as_u64().expect("id") as u32).collect::<Vec<_>>();
    v["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| (c["text"].as_str().unwrap_or("").to_string(), ids(&c["prompt_ids"]), ids(&c["greedy"])))
        .collect()
}

#[test]
fn smollm2_matches_mlx_lm_reference_on_dense_and_paged() {
    let dir = common::smollm2();
    let (model, tok) = common::load(&dir);
    let cases = cases();
    assert_eq!(cases.len(), 4);
    for (i, (text, prompt, expected)) in cases.iter().enumerate() {
        // The tokenizer and chat template reproduce the reference prompt ids too.
        let ours = if i % 2 == 1 { tok.encode_chat(text).unwrap() } else { tok.encode_raw(text).unwrap() };
        assert_eq!(&ours, prompt, "prompt ids for case {i} ({text:?})");

        let mut dense = DenseCache::new(model.kv_shape());
        let (_, trace) = generate(&model, &mut dense, prompt, expected.len()).unwrap();
        assert_eq!(&trace.tokens, expected, "dense greedy tokens, case {i} ({text:?})");

        for bs in [32, 16] {
            let opts = PoolOptions { block_size: bs, poison: true, ..PoolOptions::default() };
            let mut paged = PagedBlockPool::new(model.kv_shape(), opts, Faults::NONE).unwrap();
            let (seq, trace) = generate(&model, &mut paged, prompt, expected.len()).unwrap();
            assert_eq!(&trace.tokens, expected, "paged (block {bs}) greedy tokens, case {i}");
            assert_eq!(paged.len(seq).unwrap(), prompt.len() + expected.len() - 1);
        }
    }
}

/// mlx-lm on the tiny fixtures (`ci/fixture-references` writes the file): Llama 3 RoPE scaling
/// with GQA and an untied head, Qwen3 with q/k norms and a 4-bit tied embedding, 8-bit group 64.
/// An independent implementation of each forward pass, token for token.
#[test]
fn fixtures_match_mlx_lm_references() {
    let path = common::repo().join("fixtures/reference/mlx-lm-f32.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("fixture references")).unwrap();
    let ids = |x: &Value| x.as_array().expect("ids").iter().map(|i| i.as_u64().expect("id") as u32).collect::<Vec<_>>();
    let fixtures = v["fixtures"].as_object().expect("fixtures");
    assert!(fixtures.len() >= 3);
    for (name, cases) in fixtures {
        let (model, _) = common::load(&common::fixture(name));
        for case in cases.as_array().unwrap() {
            let (prompt, expected) = (ids(&case["prompt_ids"]), ids(&case["greedy"]));
            let mut dense = DenseCache::new(model.kv_shape());
            let (_, trace) = generate(&model, &mut dense, &prompt, expected.len()).unwrap();
            assert_eq!(trace.tokens, expected, "{name}, prompt of {} tokens", prompt.len());
        }
    }
}

/// Gemma 3 270M converted from its GGUF (`ci/gemma3-270m`, which ./ci/test runs), float32, against
/// mlx-lm's greedy tokens on the same files (`ci/gemma3_reference.py` wrote the file, where
/// mlx-lm's own RotatingKVCache and a KVCache on every layer agreed): three short prompts and
/// one of 802 tokens, past the 512-position window, so the sliding layers' windows move in
/// prefill and in decode. Dense, and paged with blocks of 48 rows (which do not divide the
/// window: windows begin and end inside blocks).
#[test]
fn gemma3_270m_matches_mlx_lm_reference_on_dense_and_paged() {
    common::cpu();
    let dir = std::env::var_os("PARITY_GEMMA3")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| common::repo().join(".deps/gemma3-270m-1.0.0/checkpoint"));
    assert!(dir.join("model.safetensors").is_file(), "{} is missing: run ci/gemma3-270m", dir.display());
    let path = common::repo().join("fixtures/reference/gemma3-270m-f32-mlx-lm.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("gemma3 reference")).unwrap();
    assert_eq!((v["dtype"].as_str(), v["window"].as_u64()), (Some("float32"), Some(512)));
    let ids = |x: &Value| x.as_array().expect("ids").iter().map(|i| i.as_u64().expect("id") as u32).collect::<Vec<_>>();
    let (model, tok) = common::load(&dir);
    let cases = v["cases"].as_array().expect("cases");
    assert!(cases.iter().any(|c| c["prompt_ids"].as_array().is_some_and(|p| p.len() > 512)));
    for case in cases {
        let (text, prompt, expected) = (case["text"].as_str().unwrap(), ids(&case["prompt_ids"]), ids(&case["greedy"]));
        assert_eq!(tok.encode_raw(text).unwrap(), prompt, "prompt ids of {} tokens", prompt.len());
        let mut dense = DenseCache::new(model.kv_shape());
        let (_, trace) = generate(&model, &mut dense, &prompt, expected.len()).unwrap();
        assert_eq!(trace.tokens, expected, "dense, prompt of {} tokens", prompt.len());
        let opts = PoolOptions { block_size: 48, poison: true, ..PoolOptions::default() };
        let mut paged = PagedBlockPool::new(model.kv_shape(), opts, Faults::NONE).unwrap();
        let (_, trace) = generate(&model, &mut paged, &prompt, expected.len()).unwrap();
        assert_eq!(trace.tokens, expected, "paged (block 48), prompt of {} tokens", prompt.len());
    }
}
