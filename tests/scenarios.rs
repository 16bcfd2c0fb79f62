//! Every scenario on both backends on the tiny fixtures gives the dense reference's tokens,
//! with logits that match to float32 noise.

mod common;

use parity::compare::{self, Verdict};
use parity::dtype::DtypeName;
use parity::faults::Faults;
use parity::kv::Backend;
use parity::model::AttentionMode;
use parity::scenario::{self, Harness, Prompt, Settings};

/// Lengths that cross every boundary of block size 4 and tile 8: block-1, block+1, tile-1,
/// tile+1, an exact multiple, and a longer one.
fn prompts() -> Vec<Prompt> {
    let text = "The quick brown fox jumps over the lazy dog while parity checks the cache";
    [3, 5, 7, 9, 16, 21]
        .into_iter()
        .map(|n| Prompt { name: format!("len{n}"), ids: text.as_bytes()[..n].iter().map(|&b| b as u32).collect() })
        .collect()
}

fn settings() -> Settings {
    Settings {
        max_tokens: 12,
        block_size: 4,
        tile: 8,
        chunk: 5,
        lookahead: 3,
        rollback_every: 4,
        ..Settings::default()
    }
}

/// Both attention modes: batched (the default) and row by row (the reference form).
#[test]
fn every_scenario_matches_the_reference_on_both_backends() {
    for (fixture, mode) in ["llama-tiny", "qwen3-tiny"]
        .into_iter()
        .flat_map(|f| [AttentionMode::Batched, AttentionMode::RowByRow].map(|m| (f, m)))
    {
        let (model, _) = common::load(&common::fixture(fixture));
        model.set_attention_mode(mode);
        let mut h = Harness::new(&model, settings(), Faults::NONE);
        let prompts = prompts();
        for &sc in scenario::ALL {
            for backend in [Backend::Dense, Backend::Paged] {
                let cases = sc
                    .run(&mut h, backend, &prompts)
                    .unwrap_or_else(|e| panic!("{fixture} {} {}: {e}", sc.name(), backend.name()));
                assert!(!cases.is_empty(), "{} produced no cases", sc.name());
                for c in cases {
                    let reference = h.reference(&c.prompt.ids).unwrap();
                    for (row, path) in c.paths.iter().enumerate() {
                        assert!(!path.tokens.is_empty());
                        let cmp = compare::compare(&reference, path, DtypeName::Float32, 1e-3).unwrap();
                        let what = format!(
                            "{fixture} {} {} {} {} {} row {row}",
                            mode.name(),
                            sc.name(),
                            c.case,
                            c.prompt.name,
                            backend.name()
                        );
                        assert!(
                            matches!(cmp.verdict, Verdict::Identical | Verdict::NearTie),
                            "{what}: {:?} {:?}",
                            cmp.verdict,
                            cmp.first_divergence
                        );
                        assert!(cmp.max_rel_rms < 1e-4, "{what}: rel RMS {}", cmp.max_rel_rms);
                    }
                }
            }
        }
    }
}

/// Half precision is an explicit setting: the model computes in it, KV is stored in it, and
/// the paths still agree (the default tolerance for half precision is 2e-2).
#[test]
fn bfloat16_and_native_dtypes_run_and_agree() {
    use parity::checkpoint::ModelConfig;
    use parity::dtype::DtypeName;
    use parity::model::Model;
    let dir = common::fixture("qwen3-tiny");
    for (setting, expected) in [(Some(DtypeName::Bfloat16), DtypeName::Bfloat16), (None, DtypeName::Bfloat16)] {
        // qwen3-tiny stores bfloat16, so `native` (None) is bfloat16 too.
        let model = Model::load(&dir, ModelConfig::load(&dir).unwrap(), setting, false).unwrap();
        assert_eq!(model.dtype, expected);
        assert_eq!(model.kv_shape().dtype, expected);
        let mut h = Harness::new(&model, settings(), Faults::NONE);
        let prompts = prompts();
        for sc in [scenario::Scenario::Single, scenario::Scenario::Batch2] {
            let cases = sc.run(&mut h, Backend::Paged, &prompts).unwrap();
            for c in cases {
                let reference = h.reference(&c.prompt.ids).unwrap();
                assert_eq!(reference.logits[0].dtype(), mlx_rs::Dtype::Bfloat16);
                for path in &c.paths {
                    let cmp = compare::compare(&reference, path, expected, 2e-2).unwrap();
                    assert!(
                        matches!(cmp.verdict, Verdict::Identical | Verdict::NearTie),
                        "{} {}: {:?}",
                        sc.name(),
                        c.case,
                        cmp.first_divergence
                    );
                }
            }
        }
    }
}
