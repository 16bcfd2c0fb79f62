//! Lossy paths judged by distribution (the `corpus` scenario): a corpus read teacher-forced
//! beside the reference, summarised as KL, probability change, top-1 and top-k agreement by
//! position, and held to bounds on that distribution. The shipped suite is suites/lossy.toml;
//! these run a short corpus on a fixture and on the real SmolLM2.

use crate::common;

use parity::report::{Report, Row};
use parity::vocab::{DistributionTolerance, Verdict};

/// A scratch suite: the shipped corpus cut to `tokens` positions, `entries` appended.
fn suite(name: &str, tokens: usize, extra_prompts: &str, entries: &str) -> std::path::PathBuf {
    let repo = common::repo();
    let text = format!(
        r#"name = "{name}"
dtype = "float32"
scenarios = ["corpus"]
[settings]
corpus_tokens = {tokens}
[[prompts]]
name = "moby-dick"
file = "{corpus}"
length = {length}
{extra_prompts}
{entries}
"#,
        corpus = repo.join("corpus/moby-dick-1-3.txt").display(),
        length = tokens + 1,
    );
    let file = common::scratch(&format!("{name}-suite")).join("suite.toml");
    std::fs::write(&file, text).expect("write suite");
    file
}

fn mlx_lm_engine(model_args: &str, paths: &str) -> String {
    let repo = common::repo();
    format!(
        r#"engine = {{ kind = "process", command = ["{mlx}", "{adapter}", "--model", "{{model}}", "--dtype", "{{dtype}}"{model_args}], reference = "KVCache", paths = {{ KVCache = ["--cache", "kv"], {paths} }} }}"#,
        mlx = repo.join("ci/mlx-lm").display(),
        adapter = repo.join("adapters/mlx_lm_adapter.py").display(),
    )
}

fn row<'a>(r: &'a Report, scenario: &str, path: &str) -> Vec<&'a Row> {
    r.rows.iter().filter(|row| row.scenario == scenario && row.path == path).collect()
}

/// parity's own dense and paged paths read the corpus exactly alike: every argmax agrees and
/// KL is rounding, so with no bound named the rows are `identical`. A bound that is broken
/// fails its row with the measured value; one that holds makes it `within`.
#[test]
fn the_corpus_scenario_on_builtin_paths_and_its_bounds() {
    let fixture = common::repo().join("fixtures/qwen3-tiny.toml");
    let exact = format!("[[checkpoints]]\npath = \"{}\"\nbackends = [\"dense\", \"paged\"]\n", fixture.display());
    let file = suite("corpus-builtin", 40, "", &exact);
    let (code, out, r) = common::run_report("corpus-builtin", &[file.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}");
    for path in ["dense", "paged"] {
        let rows = row(&r, "corpus", path);
        assert_eq!(rows.len(), 1, "{out}");
        let d = rows[0].distribution.as_ref().expect("distribution");
        assert_eq!(d.positions, 40);
        assert_eq!(rows[0].verdict, Verdict::Identical, "{out}");
        assert_eq!(d.top1_agree, 1.0);
        assert!(d.kl.max < 1e-5, "{path}: KL {}", d.kl.max);
        assert_eq!(rows[0].bounds.len(), 1, "exactness: every argmax agrees");
        let bands: Vec<(usize, usize)> = d.by_position.iter().map(|b| (b.from, b.to)).collect();
        assert_eq!(bands, [(0, 32), (32, 64)]);
    }
    assert!(out.contains("lossy paths over their corpus"), "{out}");

    // A bound no path can meet (KL exactly 0 at every position of a paged read is not
    // promised: float order) and one it meets.
    let bounded = format!("{exact}tolerance = {{ kl_max = 0.0, top1_agree = 0.99 }}\n");
    let file = suite("corpus-bounds", 40, "", &bounded);
    let (code, out, r) = common::run_report("corpus-bounds", &[file.to_str().unwrap()]);
    let paged = row(&r, "corpus", "paged")[0];
    let broken: Vec<&str> = paged.bounds.iter().filter(|b| !b.held).map(|b| b.name.as_str()).collect();
    if broken.is_empty() {
        assert_eq!(paged.verdict, Verdict::Within, "{out}");
    } else {
        assert_eq!((code, paged.verdict, broken.as_slice()), (1, Verdict::Diverged, ["kl_max"].as_slice()), "{out}");
        let failure = paged.failure.as_deref().unwrap_or_default();
        assert!(failure.starts_with("distribution: kl_max ") && failure.contains("not <= 0"), "{failure}");
    }
    assert!(paged.bounds.iter().any(|b| b.name == "top1_agree" && b.held && b.measured == 1.0));
}

/// mlx-lm's QuantizedKVCache on a fixture (head_dim 32: groups of 32): 4 bits are further
/// from the full cache than 8 bits at every summary, and the markdown report tables both.
#[test]
fn quantized_caches_on_the_fixture_are_ordered_by_bits() {
    let fixture = common::repo().join("fixtures/qwen3-tiny.toml");
    let paths = r#"q8 = ["--cache", "quantized", "--bits", "8", "--group-size", "32"], q4 = ["--cache", "quantized", "--bits", "4", "--group-size", "32"]"#;
    let entry = format!(
        "[[checkpoints]]\npath = \"{}\"\n{}\nbackends = [\"q8\", \"q4\"]\ntolerance = {{ kl_mean = 1.0 }}\n",
        fixture.display(),
        mlx_lm_engine("", paths)
    );
    let file = suite("corpus-mlx-lm", 48, "", &entry);
    let md = common::scratch("corpus-mlx-lm").join("r.md");
    let (code, out, r) =
        common::run_report("corpus-mlx-lm", &[file.to_str().unwrap(), "--markdown", md.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}");
    let d = |p: &str| row(&r, "corpus", p)[0].distribution.clone().expect("distribution");
    let (q8, q4) = (d("q8"), d("q4"));
    assert_eq!((q8.positions, q4.positions), (48, 48));
    assert!(q4.kl.mean > q8.kl.mean && q4.kl.p99 > q8.kl.p99, "q8 {:?} q4 {:?}", q8.kl, q4.kl);
    assert!(q4.dp_rms > q8.dp_rms);
    assert!(row(&r, "corpus", "q8")[0].verdict == Verdict::Within);
    assert!(out.contains("1 within"), "the group lines count `within` rows: {out}");
    let md = std::fs::read_to_string(md).expect("markdown");
    assert!(md.contains("### Lossy paths over their corpus") && md.contains("| q4 |"), "{md}");
}

/// A planted lossy regression: the declared format is 8-bit with groups of 32, and the path
/// silently quantizes in groups of 64. Over a corpus the mean KL doubles, many standard errors
/// apart, so a bound pinned at the declared format's baseline breaks; the worst-step view of
/// plain decode cannot tell the two apart (each prompt's largest relative RMS overlaps between
/// them, and both are far over the exact tolerance).
#[test]
fn a_doubled_quantization_group_moves_the_distribution_not_the_worst_step() {
    let smollm2 = common::smollm2();
    let paths = r#"declared = ["--cache", "quantized", "--bits", "8", "--group-size", "32"], doubled = ["--cache", "quantized", "--bits", "8", "--group-size", "64"]"#;
    let entry = format!(
        "[[checkpoints]]\nname = \"smollm2\"\npath = \"{}\"\n{}\nbackends = [\"declared\", \"doubled\"]\nscenarios = [\"corpus\", \"single\"]\nsettings = {{ max_tokens = 16 }}\n",
        smollm2.display(),
        mlx_lm_engine(r#", "--dequantize""#, paths)
    );
    let prompts = "[[prompts]]\nname = \"france\"\nchat = \"What is the capital of France? Answer in one sentence.\"\n\
                   [[prompts]]\nname = \"story\"\ntext = \"Once upon a time, in a small village by the sea, there lived an old fisherman who\"\n";
    let file = suite("corpus-planted", 128, prompts, &entry);
    let (_, out, r) = common::run_report("corpus-planted", &[file.to_str().unwrap()]);
    let corpus = |p: &str| {
        row(&r, "corpus", p)
            .into_iter()
            .find(|row| row.prompt == "moby-dick")
            .and_then(|row| row.distribution.clone())
            .unwrap_or_else(|| panic!("{p}: {out}"))
    };
    let (declared, doubled) = (corpus("declared"), corpus("doubled"));
    let gap = doubled.kl.mean - declared.kl.mean;
    let se = declared.kl.mean_se + doubled.kl.mean_se;
    assert!(gap > 5.0 * se, "declared {:?}, doubled {:?}", declared.kl, doubled.kl);
    // The suite's bound, pinned at the declared format's baseline and its uncertainty.
    let pinned = DistributionTolerance {
        kl_mean: Some(declared.kl.mean + 5.0 * declared.kl.mean_se),
        ..DistributionTolerance::default()
    };
    assert!(pinned.check(&declared).iter().all(|b| b.held));
    assert!(pinned.check(&doubled).iter().all(|b| !b.held), "the doubled group breaks it");

    // The worst-step view: one largest relative RMS per prompt of plain decode.
    let worst = |p: &str| -> Vec<f32> { row(&r, "single", p).iter().filter_map(|row| row.max_rel_rms).collect() };
    let (a, b) = (worst("declared"), worst("doubled"));
    assert_eq!((a.len(), b.len()), (3, 3), "{out}");
    let tolerance = 1e-3;
    assert!(a.iter().chain(&b).all(|&x| x > tolerance), "both far over the exact tolerance: {a:?} {b:?}");
    let (a_max, b_min) = (a.iter().copied().fold(0.0, f32::max), b.iter().copied().fold(f32::MAX, f32::min));
    assert!(a_max >= b_min, "the worst steps overlap: declared {a:?}, doubled {b:?}");
}

/// `corpus` on a server (tests/servers/fake_openai.py): one request per position, the text so
/// far as the prompt and max_tokens 1, judged from the top-k logprobs the server returns. A
/// server identical to the reference reads KL 0 at every position; one whose distributions
/// carry noise breaks its bounds; one whose prompt cache never hits computed each position by
/// prefill, not over the cache, and is `vacuous` however close it reads; one that counts the
/// prompt otherwise than parity sent it is an error naming the position.
#[test]
fn the_corpus_scenario_on_a_server_from_its_top_k() {
    let repo = common::repo();
    let tag = format!("parity-lossy-openai-{}", std::process::id());
    let entry = format!(
        r#"[[checkpoints]]
name = "tiny"
path = "{fixture}"
backends = ["same", "noisy", "uncached", "miscounted"]
tolerance = {{ kl_mean = 0.01, top1_agree = 0.9 }}
[checkpoints.engine]
kind = "openai"
name = "fake"
command = ["python3", "{server}", "--port", "{{port}}", "--tag", "{tag}", "--token-delay", "0"]
prompt = "ids"
top_logprobs = 20
start_timeout = 20
timeout = 20
reference = "exact"
[checkpoints.engine.paths]
exact = []
same = []
noisy = ["--mode", "noise", "--arg", "1.0"]
uncached = ["--mode", "cache-never-hits"]
miscounted = ["--count-off", "1"]
"#,
        fixture = repo.join("fixtures/llama-tiny.toml").display(),
        server = repo.join("tests/servers/fake_openai.py").display(),
    );
    let file = suite("corpus-openai", 40, "", &entry);
    let (code, out, r) = common::run_report("corpus-openai", &[file.to_str().unwrap()]);
    assert_eq!(code, 1, "{out}");
    let one = |p: &str| {
        let rows = row(&r, "corpus", p);
        assert_eq!(rows.len(), 1, "{p}: {out}");
        rows[0]
    };
    let same = one("same");
    let d = same.distribution.as_ref().expect("distribution");
    assert_eq!((same.verdict, same.pass, d.positions), (Verdict::Within, true, 40), "{out}");
    assert_eq!((d.kl.max, d.top1_agree, d.topk_overlap, d.dp_max), (0.0, 1.0, 1.0, 0.0), "{out}");
    assert!(same.notes.iter().any(|n| n.contains("KL over the reference's top-20")), "{:?}", same.notes);
    let cached = same.evidence.iter().find(|e| e.claim == "cached").expect("cached evidence");
    assert!(cached.seen.starts_with("39 of 39 requests"), "{cached:?}");

    let noisy = one("noisy");
    let d = noisy.distribution.as_ref().expect("distribution");
    assert_eq!(noisy.verdict, Verdict::Diverged, "{out}");
    assert!(d.kl.mean > 0.01 && d.top1_agree < 1.0, "{:?}", d.kl);
    assert!(noisy.failure.as_deref().unwrap_or_default().starts_with("distribution: kl_mean "), "{:?}", noisy.failure);

    let uncached = one("uncached");
    assert_eq!((uncached.verdict, uncached.pass), (Verdict::Vacuous, false), "{out}");
    assert!(
        uncached.failure.as_deref().unwrap_or_default().contains("cached: wanted each position"),
        "{:?}",
        uncached.failure
    );
    assert_eq!(uncached.distribution.as_ref().map(|d| d.kl.max), Some(0.0), "the same distributions, read by prefill");

    let miscounted = one("miscounted");
    assert_eq!(miscounted.verdict, Verdict::Error, "{out}");
    let failure = miscounted.failure.as_deref().unwrap_or_default();
    assert!(failure.contains("position 0") && failure.contains("counted 2 prompt tokens, parity sent 1"), "{failure}");
    common::assert_no_leftovers(&tag);
}

/// A path that answers a NaN logit mid-corpus fails its row at that position. Before the
/// check, its KL read as 0 there (`f32::max` drops a NaN), so a path emitting NaN could read
/// as closer to the reference than an exact one; its healthy twin still passes.
#[test]
fn nan_logits_fail_a_corpus_row_instead_of_reading_as_exact() {
    let repo = common::repo();
    let parity = env!("CARGO_BIN_EXE_parity");
    let misbehave = repo.join("tests/adapters/misbehave.py");
    let entry = format!(
        r#"[[checkpoints]]
path = "{fixture}"
backends = ["healthy", "nan"]
[checkpoints.engine]
kind = "process"
command = ["env"]
reference = "dense"
[checkpoints.engine.paths]
dense = [{parity:?}, "adapter", "{{model}}", "--path", "dense"]
healthy = [{parity:?}, "adapter", "{{model}}", "--path", "paged"]
nan = ["python3", {misbehave:?}, "nan-logits", "3", "--", {parity:?}, "adapter", "{{model}}", "--path", "paged"]
"#,
        fixture = repo.join("fixtures/qwen3-tiny.toml").display(),
        misbehave = misbehave.display().to_string(),
    );
    let file = suite("corpus-nan", 24, "", &entry);
    let (code, out, r) = common::run_report("corpus-nan", &[file.to_str().unwrap()]);
    assert_eq!(code, 1, "{out}");
    let healthy = row(&r, "corpus", "healthy");
    assert_eq!(healthy.len(), 1, "{out}");
    assert!(healthy[0].pass, "{:?}", healthy[0].failure);
    let nan = row(&r, "corpus", "nan");
    assert_eq!(nan.len(), 1, "{out}");
    assert!(!nan[0].pass, "{out}");
    let failure = nan[0].failure.as_deref().unwrap_or_default();
    assert!(failure.contains("the path's logits (corpus position) are not finite"), "{failure}");
}
