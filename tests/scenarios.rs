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

/// A step's logits on the host, as float32.
fn floats(a: &mlx_rs::Array) -> Vec<f32> {
    let a = a.as_dtype(mlx_rs::Dtype::Float32).unwrap();
    a.eval().unwrap();
    a.as_slice::<f32>().to_vec()
}

/// Sessions that begin alike (sequences created, then one row prefilled into the empty store)
/// are served that first forward from [`parity::Prefills`]: what follows must be what computing
/// it gives, bit for bit (logits of every later step, the store's memory and books, the calls
/// counted), on every path, for the session that kept it and for two served ones. Guards a
/// restore that loses a created sequence, the store's books or the calls counted, served
/// logits that are not what the forward computes, and a kept store written through by the
/// session that shares its buffers.
#[test]
fn a_prefill_served_from_kept_prefills_leaves_the_session_as_computing_it() {
    use parity::EnginePath;
    use parity::kv::SeqId;
    use parity::model::RowStep;
    let (model, _) = common::load(&common::fixture("llama-tiny"));
    let ids = |n: usize| prompts().into_iter().find(|p| p.ids.len() == n).unwrap().ids;
    let (p, q) = (ids(9), ids(5));
    // Two sequences created, the first prefilled (served on the second and third runs), the
    // second prefilled (always computed), the first's last two rows trimmed and written again
    // with other tokens (a write through to the kept store would change what the next session
    // is served), then three batched decode steps.
    let run = |path: &mut dyn EnginePath| -> Vec<Vec<f32>> {
        let mut s = path.session(Faults::NONE).unwrap();
        let (a, b) = (s.create(0).unwrap(), s.create(0).unwrap());
        let mut out = Vec::new();
        for (seq, tokens) in [(a, p.clone()), (b, q.clone())] {
            out.push(floats(&s.forward(&[RowStep::new(seq, tokens)]).unwrap()));
        }
        // Rows the kept store holds as live, rewritten with other tokens.
        assert_eq!(s.trim(a, 2).unwrap(), 2);
        out.push(floats(&s.forward(&[RowStep::new(a, vec![7, 8])]).unwrap()));
        for t in 0..3u32 {
            let rows = [RowStep::new(a, vec![40 + t]), RowStep::new(b, vec![50 + t])];
            out.push(floats(&s.forward(&rows).unwrap()));
        }
        assert!(s.audit().unwrap().is_none());
        let lens: Vec<usize> = [a, b].iter().map(|&q| s.len(q).unwrap()).collect();
        assert_eq!(lens, [p.len() + 3, q.len() + 3]);
        assert_eq!(s.len(SeqId(2)).ok(), None, "no third sequence");
        let stats = s.stats().unwrap().unwrap();
        let counters = s.counters().unwrap().unwrap();
        out.push(vec![stats.bytes_live as f32, stats.peak_bytes_in_use as f32, stats.blocks_in_use as f32]);
        out.push(vec![counters.forwards.unwrap() as f32, counters.tokens.unwrap() as f32]);
        out
    };
    for p in BuiltinPath::ALL {
        let prefills = parity::Prefills::default();
        let computed = run(&mut Builtin::new(&model, p, &settings()));
        let mut shared = Builtin::new(&model, p, &settings()).sharing(&prefills);
        let first = run(&mut shared);
        assert_eq!(prefills.served(), 0, "{}: the first session computes", p.name());
        let (second, third) = (run(&mut shared), run(&mut shared));
        assert_eq!(prefills.served(), 2, "{}: later sessions are served their first prefill", p.name());
        for (i, got) in [first, second, third].iter().enumerate() {
            for (step, (g, c)) in got.iter().zip(&computed).enumerate() {
                let same = g.len() == c.len() && g.iter().zip(c).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "{} run {i}, step {step}: differs from computing it", p.name());
            }
        }
    }
}

/// A kept prefill serves only the same first forward of the same path with the same faults.
/// Guards a fault-free prefill served to a path with a planted fault (the fault would never
/// run, and a suite would pass it), and a store of one shape served to a session of another.
#[test]
fn kept_prefills_are_served_to_the_same_path_faults_and_sequences_only() {
    use parity::EnginePath;
    use parity::faults::Fault;
    use parity::model::RowStep;
    let (model, _) = common::load(&common::fixture("llama-tiny"));
    let prompt = prompts().into_iter().find(|p| p.ids.len() == 9).unwrap().ids;
    let first = |path: &mut dyn EnginePath, faults: Faults, created: usize, masked: usize| -> Vec<f32> {
        let mut s = path.session(faults).unwrap();
        let seq = s.create(masked).unwrap();
        for _ in 1..created {
            s.create(0).unwrap();
        }
        floats(&s.forward(&[RowStep::new(seq, prompt.clone())]).unwrap())
    };
    let prefills = parity::Prefills::default();
    let faulty = Faults::only(Fault::GatherOffByOne);
    let clean = first(&mut Builtin::new(&model, Backend::Paged, &settings()).sharing(&prefills), Faults::NONE, 1, 0);
    let planted = first(&mut Builtin::new(&model, Backend::Paged, &settings()).sharing(&prefills), faulty, 1, 0);
    let alone = first(&mut Builtin::new(&model, Backend::Paged, &settings()), faulty, 1, 0);
    // No planted fault changes a fresh store's first prefill today (they live in decode's reads,
    // batching and trims), so what shows that the fault is part of the key is that the faulty
    // session computed its own.
    assert_eq!(prefills.served(), 0, "the faulty path computed its own");
    assert_eq!(planted, alone);
    assert_eq!(clean, alone);
    // Another path, another count of created sequences, a masked sequence: each computes.
    first(&mut Builtin::new(&model, Backend::Dense, &settings()).sharing(&prefills), Faults::NONE, 1, 0);
    first(&mut Builtin::new(&model, Backend::Paged, &settings()).sharing(&prefills), Faults::NONE, 2, 0);
    first(&mut Builtin::new(&model, Backend::Paged, &settings()).sharing(&prefills), Faults::NONE, 1, 2);
    assert_eq!(prefills.served(), 0);
    first(&mut Builtin::new(&model, Backend::Paged, &settings()).sharing(&prefills), Faults::NONE, 1, 0);
    assert_eq!(prefills.served(), 1, "the same first forward again is served");
}

/// `repeat` holds a path's second run to its first, bit for bit: both runs compute every
/// forward. Guards its first prefills served from the first run's, which would compare a
/// computation with itself and hide the nondeterminism the scenario exists to catch.
#[test]
fn repeat_computes_both_runs_where_other_scenarios_are_served_kept_prefills() {
    let (model, _) = common::load(&common::fixture("llama-tiny"));
    let prompts = prompts();
    for (sc, served) in [(vocab::Scenario::Repeat, false), (vocab::Scenario::Concurrent, true)] {
        let prefills = parity::Prefills::default();
        let mut reference = Builtin::new(&model, Backend::Dense, &settings());
        let mut h = Setup::new(&mut reference, settings(), Faults::NONE, pad(&model));
        let mut path = Builtin::new(&model, Backend::Paged, &settings()).sharing(&prefills);
        for _ in 0..2 {
            for c in parity::run_scenario(sc, &mut h, &mut path, &prompts) {
                assert_eq!(c.outcome, Outcome::Ran, "{} {}", sc.name(), c.case);
            }
        }
        assert_eq!(prefills.served() > 0, served, "{}: {} prefills served", sc.name(), prefills.served());
    }
}
