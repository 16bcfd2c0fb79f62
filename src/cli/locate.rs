//! `parity locate`: run one builtin path on two devices with every intermediate tapped and name
//! the first layer and operation where they part (`crate::locate`). Each side is this
//! executable again in a child (`--dump`), since MLX keeps one default device per process.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args as ClapArgs;

use crate::checkpoint::{self, ModelConfig, Tokenizer};
use crate::dtype::DtypeSetting;
use crate::environment::DeviceChoice;
use crate::faults::{Fault, Faults};
use crate::locate::{self, Plan};
use crate::model::Model;
use crate::proc::{Child, Spawn, Stdout};
use crate::vocab::{BuiltinPath, Device, Settings};

#[derive(ClapArgs)]
pub struct Args {
    /// Checkpoint: a directory, a Hugging Face repo id in the local cache, or a fixture spec.
    checkpoint: String,
    /// Prompt text (see --chat), or give token ids with --ids.
    #[arg(long, conflicts_with = "ids", required_unless_present = "ids")]
    prompt: Option<String>,
    /// Prompt token ids, comma separated.
    #[arg(long, value_delimiter = ',')]
    ids: Option<Vec<u32>>,
    /// Render the prompt with the checkpoint's chat template.
    #[arg(long)]
    chat: bool,
    /// The device under test.
    #[arg(long, default_value = "gpu")]
    on: Device,
    /// The device it is compared with (its greedy tokens feed both sides' decode steps).
    #[arg(long, default_value = "cpu")]
    against: Device,
    /// The builtin path both sides run.
    #[arg(long, default_value = "dense", value_name = "dense|paged|dense-rowwise|paged-rowwise")]
    path: BuiltinPath,
    /// Copies of the prompt decoded together.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Decode steps after the prefill.
    #[arg(long, default_value_t = 4)]
    steps: usize,
    /// Compute dtype: float32, bfloat16, float16 or native.
    #[arg(long, default_value = "float32")]
    dtype: DtypeSetting,
    /// Dequantize quantized weights at load.
    #[arg(long)]
    dequantize: bool,
    /// Rows per KV block (paged path).
    #[arg(long, default_value_t = 32)]
    block_size: usize,
    /// Plant a fault on the --on side only (see `parity selftest`): what a located regression
    /// looks like.
    #[arg(long = "fault", value_parser = super::run::parse_fault)]
    faults: Vec<Fault>,
    /// A tap whose relative RMS difference passes this is where the sides part. Float32
    /// reduction-order noise between devices stays near 1e-6 per operation.
    #[arg(long, default_value_t = 1e-4)]
    threshold: f64,
    /// Every tap's comparison as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// (A side's child) record the taps into this file instead of comparing.
    #[arg(long, hide = true, requires = "dump_device")]
    dump: Option<PathBuf>,
    #[arg(long, hide = true)]
    dump_device: Option<Device>,
    /// (A side's child) the tokens its decode steps are fed.
    #[arg(long, hide = true, value_delimiter = ',')]
    forced: Option<Vec<u32>>,
}

impl Args {
    /// The device this process computes on: only a side's child computes.
    pub fn device(&self) -> Option<super::DeviceArg> {
        self.dump_device.map(|d| super::DeviceArg {
            device: match d {
                Device::Cpu => DeviceChoice::Cpu,
                Device::Gpu => DeviceChoice::Gpu,
            },
        })
    }
}

pub fn run(a: Args) -> Result<ExitCode> {
    let cwd = std::env::current_dir()?;
    let dir = checkpoint::resolve(&a.checkpoint, &cwd)?;
    if let Some(out) = &a.dump {
        return record(&a, &dir, out);
    }
    let ids = match (&a.ids, &a.prompt) {
        (Some(ids), _) => ids.clone(),
        (None, Some(text)) => {
            let tokenizer = Tokenizer::load(&dir)?;
            if a.chat { tokenizer.encode_chat(text)? } else { tokenizer.encode_raw(text)? }
        }
        (None, None) => bail!("give --prompt or --ids"),
    };
    if ids.is_empty() {
        bail!("the prompt encodes to zero tokens");
    }
    let scratch = std::env::temp_dir().join(format!("parity-locate-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).with_context(|| format!("creating {}", scratch.display()))?;
    let result = (|| {
        let against_file = scratch.join("against.safetensors");
        side(&a, &ids, a.against, &[], None, &against_file)?;
        let against = locate::read(&against_file)?;
        let forced = against.greedy[..a.steps].to_vec();
        let on_file = scratch.join("on.safetensors");
        side(&a, &ids, a.on, &a.faults, Some(&forced), &on_file)?;
        let on = locate::read(&on_file)?;
        Ok::<_, anyhow::Error>(locate::compare(&on, &against, a.threshold)?)
    })();
    std::fs::remove_dir_all(&scratch).ok();
    let loc = result?;
    print!("{}", loc.render());
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_string_pretty(&loc)?).with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(ExitCode::from(if loc.first.is_some() { super::EXIT_FAIL } else { 0 }))
}

/// Run one side in a child and wait for its file.
fn side(
    a: &Args,
    ids: &[u32],
    device: Device,
    faults: &[Fault],
    forced: Option<&[u32]>,
    out: &std::path::Path,
) -> Result<()> {
    let exe = std::env::current_exe().context("finding parity's own executable")?;
    let join = |v: &[u32]| v.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let mut argv = vec![
        exe.display().to_string(),
        "locate".into(),
        a.checkpoint.clone(),
        "--ids".into(),
        join(ids),
        "--path".into(),
        a.path.name(),
        "--batch".into(),
        a.batch.to_string(),
        "--steps".into(),
        a.steps.to_string(),
        "--dtype".into(),
        a.dtype.name().into(),
        "--block-size".into(),
        a.block_size.to_string(),
        "--dump".into(),
        out.display().to_string(),
        "--dump-device".into(),
        device.name().into(),
    ];
    if a.dequantize {
        argv.push("--dequantize".into());
    }
    for f in faults {
        argv.extend(["--fault".into(), f.name().into()]);
    }
    if let Some(f) = forced
        && !f.is_empty()
    {
        argv.extend(["--forced".into(), join(f)]);
    }
    let spec = Spawn {
        argv,
        cwd: std::env::current_dir()?,
        env: Vec::new(),
        stdin: false,
        stdout: Stdout::Log,
        log_file: None,
    };
    let mut child = Child::spawn(&spec).with_context(|| format!("starting the {} side", device.name()))?;
    let status = loop {
        if let Some(s) = child.exited() {
            break s;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    if !status.success() {
        bail!(
            "the {} side failed ({}): {}",
            device.name(),
            crate::proc::describe_exit(status),
            child.settled_tail(Duration::from_millis(200)).trim()
        );
    }
    Ok(())
}

/// A side's child: load, run the plan on this process's device, write the taps.
fn record(a: &Args, dir: &std::path::Path, out: &std::path::Path) -> Result<ExitCode> {
    let ids = a.ids.clone().context("a side needs --ids")?;
    let config = ModelConfig::load(dir)?;
    let model = Model::load(dir, config, a.dtype.resolve(), a.dequantize)
        .with_context(|| format!("loading {}", dir.display()))?;
    let plan = Plan { prompt: ids, batch: a.batch, steps: a.steps, path: a.path, forced: a.forced.clone() };
    let settings = Settings { block_size: a.block_size, poison: false, ..Settings::default() };
    let rec = locate::record(&model, &plan, &settings, a.faults.iter().fold(Faults::NONE, |f, &x| f.with(x)))?;
    locate::write(&rec, out)?;
    Ok(ExitCode::SUCCESS)
}
