//! Device parity: a reference pinned to a device (`builtin:dense@cpu`) runs in a child process
//! (`parity adapter --device cpu`) while the paths run on `--device`. CI has no GPU, so it is
//! checked CPU against CPU here: two processes on one device must agree bit for bit, the
//! report must name both sides' devices, and a bad spelling is a suite error before anything
//! runs. The GPU run is `ci/gpu/run device` (docs/gpu.md).

use crate::common;

use std::path::Path;

use crate::common::{assert_no_leftovers, code, command, parity, repo, run_report, scratch, text};
use parity::vocab::{BuiltinPath, BuiltinRef, Device, EngineSpec, ReferenceSpec};

/// The shipped GPU suite on the CPU: every row passes, and with every rel RMS 0, since the
/// child computes exactly what the in-process reference would (the protocol carries float32
/// logits bit for bit). The environment block, the checkpoint's engines and the Markdown name
/// both devices and `MLX_ENABLE_TF32`.
#[test]
fn cpu_paths_against_a_cpu_reference_in_a_child_pass_and_name_both_devices() {
    let (rc, out, report) = run_report(
        "device-parity",
        &["suites/gpu.toml", "--device", "cpu", "--checkpoint", "qwen3-tiny", "--markdown", "-"],
    );
    assert_eq!(rc, 0, "{out}");
    let ran: Vec<_> = report.rows.iter().filter(|r| r.verdict != parity::vocab::Verdict::Skipped).collect();
    assert!(ran.len() > 100, "{} rows ran", ran.len());
    assert!(ran.iter().all(|r| r.pass), "{out}");
    let worst = ran.iter().filter_map(|r| r.max_rel_rms).fold(0.0f32, f32::max);
    // The paged and ragged rows differ from the reference by reduction order (as in process),
    // never by the process boundary: the same bound as suites/fixtures.toml's CPU run.
    assert!(worst < 1e-5, "worst rel RMS {worst}");

    let env = &report.environment;
    assert_eq!(env.device, "cpu");
    assert_eq!(env.reference_devices.get("builtin:dense@cpu").map(String::as_str), Some("cpu"), "{env:?}");
    let c = &report.checkpoints[0];
    assert_eq!(c.reference_path.as_deref(), Some("dense@cpu"));
    let reference = c.reference_engine.as_ref().expect("reference engine");
    assert_eq!((reference.kind.as_str(), reference.device.as_deref()), ("process", Some("cpu")));
    assert_eq!(c.engine.as_ref().and_then(|e| e.device.as_deref()), Some("cpu"));
    assert!(out.contains("reference builtin:dense@cpu on cpu"), "markdown names the reference's device:\n{out}");
    assert!(out.contains("MLX_ENABLE_TF32"), "markdown names the TF32 setting:\n{out}");
    assert_no_leftovers("--device cpu --path dense");
}

/// Against the in-process reference the same rows have the same numbers: a pinned reference
/// changes where it runs, not what it computes.
#[test]
fn a_pinned_reference_computes_what_the_in_process_one_does() {
    let args =
        |suite: &'static str| vec![suite, "--device", "cpu", "--checkpoint", "llama-tiny", "--scenario", "batch2"];
    let (rc_a, out_a, pinned) = run_report("device-parity-pinned", &args("suites/gpu.toml"));
    let (rc_b, out_b, local) = run_report("device-parity-local", &args("suites/fixtures.toml"));
    assert_eq!((rc_a, rc_b), (0, 0), "{out_a}\n{out_b}");
    let key = |r: &parity::report::Row| (r.prompt.clone(), r.case.clone(), r.path.clone());
    let numbers = |rows: &[parity::report::Row]| {
        let mut v: Vec<_> = rows.iter().map(|r| (key(r), r.tokens.clone(), r.max_rel_rms.map(f32::to_bits))).collect();
        v.sort();
        v
    };
    assert_eq!(numbers(&pinned.rows), numbers(&local.rows));
}

fn suite_with(reference: &str) -> String {
    format!(
        "name = \"t\"\n[engine]\nkind = \"builtin\"\nreference = \"{reference}\"\n[[prompts]]\nname = \"p\"\ntext = \"hello\"\n[[checkpoints]]\npath = \"../fixtures/llama-tiny.toml\"\n"
    )
}

/// Each wrong spelling is the suite's error: the file, the line and column of the value, the
/// field, what is wrong and what is allowed; exit 2, no panic, nothing started.
#[test]
fn a_bad_device_or_path_is_a_suite_error_naming_file_and_field() {
    let dir = scratch("device-parity-bad");
    for (reference, needle) in [
        ("builtin:dense@tpu", "unknown device `tpu`; expected cpu or gpu"),
        ("builtin:nope@cpu", "unknown builtin path `nope`; expected dense, paged"),
        ("builtin:dense@auto", "unknown device `auto`"),
        ("dense@cpu", "is not a builtin reference"),
    ] {
        let file = dir.join("bad.toml");
        std::fs::write(&file, suite_with(reference)).expect("write suite");
        let o = parity(&["run", file.to_str().expect("utf-8"), "--no-snapshots"]);
        let out = text(&o);
        assert_eq!(code(&o), 2, "{reference}: {out}");
        assert!(!out.contains("panicked"), "{out}");
        let at = format!("{}:4:13: engine.reference: ", file.display());
        assert!(out.contains(&at) && out.contains(needle), "{reference}: expected `{at}` and `{needle}` in:\n{out}");
    }
    // The process engine takes the same spelling, with the same checks.
    let process = "name = \"t\"\n[engine]\nkind = \"process\"\ncommand = [\"x\"]\nreference = \"builtin:dense@tpu\"\n[engine.paths]\na = []\n[[prompts]]\nname = \"p\"\ntext = \"hello\"\n[[checkpoints]]\npath = \"../fixtures/llama-tiny.toml\"\n";
    let e = parity::parse_suite(Path::new("suites/x.toml"), process).expect_err("rejected");
    assert_eq!(e.line, 5, "{e}");
    assert!(e.message.contains("engine.reference: `builtin:dense@tpu`: unknown device `tpu`"), "{e}");
}

/// How the spellings parse: a pinned reference needs no weights in parity's own process when
/// the paths are another engine's (its child loads them).
#[test]
fn spellings_parse_into_a_path_and_a_device() {
    let s = parity::parse_suite(Path::new("suites/x.toml"), &suite_with("builtin:paged-rowwise@gpu")).expect("parses");
    let want = BuiltinRef { path: "paged-rowwise".parse::<BuiltinPath>().expect("path"), device: Some(Device::Gpu) };
    assert_eq!(s.checkpoints[0].engine, EngineSpec::Builtin { reference: want });
    assert_eq!(s.checkpoints[0].engine.reference().describe(), "builtin:paged-rowwise@gpu");
    let plain = parity::parse_suite(Path::new("suites/x.toml"), &suite_with("builtin:paged")).expect("parses");
    assert_eq!(plain.checkpoints[0].engine.reference(), ReferenceSpec::Builtin("paged".parse().expect("ref")));
    let process = "name = \"t\"\n[engine]\nkind = \"process\"\ncommand = [\"x\"]\nreference = \"builtin:dense@cpu\"\n[engine.paths]\na = []\n[[prompts]]\nname = \"p\"\ntext = \"hello\"\n[[checkpoints]]\npath = \"../fixtures/llama-tiny.toml\"\n";
    let s = parity::parse_suite(Path::new("suites/x.toml"), process).expect("parses");
    assert!(!s.checkpoints[0].engine.needs_builtin());
}

/// The shipped GPU suites are the CPU suites with a pinned reference: same prompts, settings,
/// tolerances, checkpoints and scenarios, so a GPU row is a CPU-accepted case on another device.
#[test]
fn the_gpu_suites_stay_the_cpu_suites_with_a_pinned_reference() {
    for (gpu, cpu) in [("suites/gpu.toml", "suites/fixtures.toml"), ("suites/gpu-smollm2.toml", "suites/smollm2.toml")]
    {
        let load = |f: &str| parity::load_suite(&repo().join(f)).unwrap_or_else(|e| panic!("{f}: {e}"));
        let (g, c) = (load(gpu), load(cpu));
        assert_eq!(g.prompts, c.prompts, "{gpu} prompts");
        assert_eq!(g.checkpoints.len(), c.checkpoints.len(), "{gpu} checkpoints");
        for (a, b) in g.checkpoints.iter().zip(&c.checkpoints) {
            assert_eq!(a.engine.reference().describe(), "builtin:dense@cpu", "{gpu} {}", a.name);
            let same = |x: &parity::vocab::CheckpointSpec| {
                (x.name.clone(), x.reference.clone(), x.paths.clone(), x.scenarios.clone(), x.prompts.clone())
            };
            assert_eq!(same(a), same(b), "{gpu} {}", a.name);
            assert_eq!((&a.settings, &a.tolerance, a.dequantize), (&b.settings, &b.tolerance, b.dequantize));
        }
    }
}

/// `parity adapter` says where it computes in its hello, so a pinned reference is checked to
/// have run where it was asked.
#[test]
fn the_adapter_names_its_device_in_hello() {
    let fixture = common::fixture("llama-tiny");
    let mut child = command()
        .args(["adapter", fixture.to_str().expect("utf-8"), "--device", "cpu"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("spawn adapter");
    let hello = r#"{"id":0,"op":"hello","protocol":1,"model":"m","path":"dense","settings":{}}"#;
    {
        use std::io::Write;
        let stdin = child.stdin.as_mut().expect("stdin");
        writeln!(stdin, "{hello}").expect("write hello");
        writeln!(stdin, r#"{{"id":1,"op":"shutdown"}}"#).expect("write shutdown");
    }
    let out = child.wait_with_output().expect("adapter output");
    let first = String::from_utf8_lossy(&out.stdout).lines().next().unwrap_or_default().to_string();
    let v: serde_json::Value = serde_json::from_str(&first).unwrap_or_else(|e| panic!("{e}: {first}"));
    assert_eq!(v["ok"], true, "{first}");
    assert_eq!(v["engine"]["device"], "cpu", "{first}");
}

fn locate(args: &[&str]) -> (i32, String, serde_json::Value) {
    let json = scratch("locate").join(format!("{}.json", args.join("_").replace(['/', ','], "-")));
    let o = command().arg("locate").args(args).arg("--json").arg(&json).output().expect("run parity locate");
    let value = std::fs::read_to_string(&json).ok().and_then(|t| serde_json::from_str(&t).ok()).unwrap_or_default();
    (code(&o), text(&o), value)
}

/// Both sides on the CPU: llama-tiny, two identical rows, a prefill and three decode steps.
const LLAMA_ON_CPU: [&str; 11] = [
    "fixtures/llama-tiny.toml",
    "--ids",
    "5,17,33,9,100,42",
    "--on",
    "cpu",
    "--against",
    "cpu",
    "--batch",
    "2",
    "--steps",
    "3",
];

/// `parity locate` on one device is bit-exact: every tap of every step agrees, exit 0. What
/// the GPU run reads as reduction-order noise starts from this zero.
#[test]
fn locate_on_one_device_finds_every_tap_equal() {
    let (rc, out, v) = locate(&LLAMA_ON_CPU);
    assert_eq!(rc, 0, "{out}");
    assert!(out.contains("every tap within rel RMS 1e-4"), "{out}");
    let diffs = v["diffs"].as_array().expect("diffs");
    // 4 steps of 31 taps: embed; per layer (2) input_norm, q/k/v_proj, rope_q/k, kv_read,
    // attention, o_proj, attn_residual, mlp_norm, mlp_gated, mlp, mlp_residual (llama: no q/k
    // or sandwich norms); final_norm, logits.
    assert_eq!(diffs.len(), 4 * 31, "{out}");
    assert!(diffs.iter().all(|d| d["rel_rms"] == 0.0), "{out}");
}

/// The RoPE stride aliasing planted on one side (row b of a batched decode rotated at its
/// offset plus b) is located where it is: not in the prefill (the fault needs one token a
/// row), not in the projections before it, but at step 1, layer 0's RoPE of q. A regression
/// guard for the locator: were taps misordered or a side fed other tokens, it would name
/// another op.
#[test]
fn locate_names_the_layer_and_operation_of_a_planted_rope_fault() {
    let (rc, out, v) = locate(&[&LLAMA_ON_CPU[..], &["--fault", "rope-batch-alias"]].concat());
    assert_eq!(rc, 1, "{out}");
    assert_eq!((v["first"]["step"].as_u64(), v["first"]["name"].as_str()), (Some(1), Some("layer 0 rope_q")), "{out}");
    assert!(out.contains("first past rel RMS 1e-4 at step 1, layer 0 rope_q"), "{out}");
}

/// A window bookkeeping fault (a sliding layer's block released one block too soon) shows at
/// the first step whose window still needs that block, in a sliding layer's cache read (fewer
/// rows than the other side's), with its q, k and RoPE exact: the pool, not the projections.
#[test]
fn locate_names_the_attention_of_a_window_released_too_early() {
    let ids = "5,17,33,9,100,42,7,8,9,10,11,12,13,14";
    let args = ["fixtures/gemma3-tiny.toml", "--ids", ids, "--on", "cpu", "--against", "cpu", "--path", "paged"];
    let (rc, out, v) =
        locate(&[&args[..], &["--block-size", "8", "--steps", "6", "--fault", "window-release-early"]].concat());
    assert_eq!(rc, 1, "{out}");
    assert_eq!(v["first"]["name"].as_str(), Some("layer 0 kv_read"), "{out}");
    assert_eq!(v["first"]["step"].as_u64(), Some(3), "{out}");
    assert!(out.contains("shape [1, 1, 9, 32] against [1, 1, 17, 32]"), "the read's widths say why: {out}");
}

#[test]
fn locate_refuses_a_token_outside_the_vocabulary_naming_it() {
    let (rc, out, _) = locate(&["fixtures/llama-tiny.toml", "--ids", "5,99999999", "--on", "cpu", "--against", "cpu"]);
    assert_eq!(rc, 2, "{out}");
    assert!(out.contains("token id 99999999 is outside the vocabulary"), "{out}");
    assert!(!out.contains("panicked"), "{out}");
}
