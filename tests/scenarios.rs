//! Every scenario on both backends on the tiny fixtures gives the dense reference's tokens,
//! with logits that match to float32 noise.

use crate::common;

use parity::Builtin;
use parity::dtype::DtypeName;
use parity::faults::Faults;
use parity::kv::Backend;
use parity::model::Model;
use parity::vocab::BuiltinPath;
use parity::vocab::Verdict;
use parity::vocab::{self, Prompt, Settings};
use parity::{Outcome, Setup};

fn pad(model: &Model) -> u32 {
    model.config.pad_token_id.or_else(|| model.config.eos_token_ids.first().copied()).unwrap_or(0)
}

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

/// Every builtin path (both backends, batched and row-by-row attention) against the
/// simplest correct form: dense, row by row.
#[test]
fn every_scenario_matches_the_reference_on_every_path() {
    let rowwise: BuiltinPath = "dense-rowwise".parse().unwrap();
    for fixture in ["llama-tiny", "qwen3-tiny"] {
        let (model, _) = common::load(&common::fixture(fixture));
        let mut reference = Builtin::new(&model, rowwise, &settings());
        let mut h = Setup::new(&mut reference, settings(), Faults::NONE, pad(&model));
        let prompts = prompts();
        for &sc in vocab::STEP_LEVEL {
            for p in BuiltinPath::ALL {
                let mut path = Builtin::new(&model, p, &settings());
                let cases = parity::run_scenario(sc, &mut h, &mut path, &prompts);
                assert!(!cases.is_empty(), "{} produced no cases", sc.name());
                for c in cases {
                    assert_eq!(c.outcome, Outcome::Ran, "{fixture} {} {} {}", sc.name(), c.case, p.name());
                    for (row, d) in c.measured.iter().enumerate() {
                        let (reference, path) = (&d.reference, &d.trace);
                        let own = h.reference(&c.prompt.ids).unwrap();
                        assert_eq!(reference.tokens, own.tokens, "the case's own reference");
                        assert!(!path.tokens.is_empty());
                        let cmp = parity::compare(reference, path, DtypeName::Float32, 1e-3).unwrap();
                        let what =
                            format!("{fixture} {} {} {} {} row {row}", sc.name(), c.case, c.prompt.name, p.name());
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
    let dir = common::fixture("qwen3-tiny");
    for (setting, expected) in [(Some(DtypeName::Bfloat16), DtypeName::Bfloat16), (None, DtypeName::Bfloat16)] {
        // qwen3-tiny stores bfloat16, so `native` (None) is bfloat16 too.
        let model = Model::load(&dir, ModelConfig::load(&dir).unwrap(), setting, false).unwrap();
        assert_eq!(model.dtype, expected);
        assert_eq!(model.kv_shape().dtype, expected);
        let mut reference = Builtin::new(&model, Backend::Dense, &settings());
        let mut h = Setup::new(&mut reference, settings(), Faults::NONE, pad(&model));
        let prompts = prompts();
        for sc in [vocab::Scenario::Single, vocab::Scenario::Batch2] {
            let mut path = Builtin::new(&model, Backend::Paged, &settings());
            for c in parity::run_scenario(sc, &mut h, &mut path, &prompts) {
                assert_eq!(c.outcome, Outcome::Ran);
                for d in &c.measured {
                    assert_eq!(d.reference.logits[0].dtype(), mlx_rs::Dtype::Bfloat16);
                    let cmp = parity::compare(&d.reference, &d.trace, expected, 2e-2).unwrap();
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

/// The batching faults live in batched attention only: a row-by-row path asked to plant one
/// refuses (its rows are skipped, naming the fault) instead of passing without planting it.
#[test]
fn rowwise_paths_refuse_the_batching_faults() {
    use parity::EnginePath;
    use parity::faults::Fault;
    use parity::model::AttentionMode;
    let (model, _) = common::load(&common::fixture("llama-tiny"));
    for p in BuiltinPath::ALL {
        let mut path = Builtin::new(&model, p, &settings());
        for f in [Fault::RopeBatchAlias, Fault::BatchRowSwap, Fault::RaggedMaskWide] {
            let planted = path.session(Faults::only(f)).is_ok();
            assert_eq!(planted, p.attention == AttentionMode::Batched, "{} {}", p.name(), f.name());
        }
        assert!(path.session(Faults::only(Fault::PadUnmasked)).is_ok(), "{}: both modes mask pads", p.name());
    }
}
