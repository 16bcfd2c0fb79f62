//! The environment a run computes in, as every report records it: MLX's device (chosen here,
//! once per process), its version, the BLAS behind its CPU matmuls, the OS and architecture.

use std::collections::BTreeMap;

use mlx_rs::{Device, DeviceType};
use serde::{Deserialize, Serialize};

use crate::error::Error;

/// What a report records about where it ran.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Environment {
    pub mlx_version: String,
    /// `cpu` or `gpu`: MLX's default device for the run.
    pub device: String,
    /// On a GPU, MLX's backend for it: `cuda` or `metal` (their arithmetic differs, so their
    /// snapshots live apart); absent on the CPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// On a GPU, its name as MLX's `device_info` gives it (`NVIDIA H200`, `Apple M2 Pro`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<String>,
    pub os: String,
    pub arch: String,
    /// The BLAS that ran MLX's CPU matmuls and the kernel it chose, when it says (OpenBLAS:
    /// `OpenBLAS 0.3.21 ... Prescott`). Bit-identity between runs depends on it, and an
    /// OpenBLAS that does not know the CPU falls back to a generic kernel 2-3x slower.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blas: Option<String>,
    /// The process's malloc when it is not the system's: `jemalloc 5.3.0 (page decay
    /// 10000/0 ms)` for the Linux CLI. MLX allocates every intermediate array through it, so decode
    /// speed depends on it (5-14% at B=1 and 8 against glibc's); arithmetic does not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocator: Option<String>,
    /// The flags MLX's CPU JIT compiles fused kernels with beyond its own, when parity set them
    /// ([`compile_mlx_kernels_for_this_cpu`]): `g++` and its `JIT_FLAGS`. Speed only; every result
    /// is the same bit for bit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mlx_jit: Option<String>,
    /// `MLX_ENABLE_TF32` as this run saw it (`None`: unset). On CUDA, MLX runs float32 matmuls
    /// as TF32 unless it is `0`, and TF32 moves batched float32 rows past a 1e-3 tolerance
    /// (docs/gpu.md, finding 4): a GPU result means little without it. Children (adapters, a
    /// pinned reference) inherit it. Other backends ignore it.
    #[serde(default)]
    pub mlx_enable_tf32: Option<String>,
    /// The devices of references run in child processes on a device of their own, by the
    /// reference as the suite wrote it (`builtin:dense@cpu` -> `cpu`), as each child said:
    /// with `device` (where this process computed its paths) they name both sides of a device
    /// parity run. Empty when every reference ran in this process.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub reference_devices: BTreeMap<String, String>,
}

impl Environment {
    /// `cpu`, or `gpu (cuda, NVIDIA H200)`: the device with what MLX said of the GPU.
    pub fn device_label(&self) -> String {
        let said: Vec<&str> = self.backend.iter().chain(&self.gpu).map(String::as_str).collect();
        if said.is_empty() { self.device.clone() } else { format!("{} ({})", self.device, said.join(", ")) }
    }

    /// `MLX_ENABLE_TF32=0`, or `MLX_ENABLE_TF32 unset`, for the renderings' one line.
    pub fn tf32_line(&self) -> String {
        match &self.mlx_enable_tf32 {
            Some(v) => format!("MLX_ENABLE_TF32={v}"),
            None => "MLX_ENABLE_TF32 unset".into(),
        }
    }

    /// `; reference builtin:dense@cpu on cpu`, for each pinned reference (empty when none).
    pub fn references_line(&self) -> String {
        self.reference_devices.iter().map(|(r, d)| format!("; reference {r} on {d}")).collect()
    }
}

/// MLX's own version string (from the linked library, not from a pin).
pub fn mlx_version() -> String {
    // SAFETY: mlx_version fills a fresh mlx_string that we read and free here.
    unsafe {
        let mut s = mlx_sys::mlx_string_new();
        let version = if mlx_sys::mlx_version(&mut s) == 0 {
            let p = mlx_sys::mlx_string_data(s);
            if p.is_null() {
                String::from("unknown")
            } else {
                std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        } else {
            String::from("unknown")
        };
        mlx_sys::mlx_string_free(s);
        version
    }
}

/// Which MLX device computes. `Auto` keeps MLX's choice: the GPU where Metal is available
/// (Apple Silicon), else the CPU. Pinning `Cpu` on a Mac is what makes `cargo test` there check
/// the same accepted CPU snapshots and mlx-lm references as Linux CI does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    #[default]
    Auto,
    Cpu,
    Gpu,
}

impl std::str::FromStr for DeviceChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            // Empty is unset, as for PARITY_UPDATE: a workflow's `${{ inputs.x }}` is empty when
            // the input was not given.
            "" | "auto" => Ok(Self::Auto),
            "cpu" => Ok(Self::Cpu),
            "gpu" => Ok(Self::Gpu),
            other => Err(format!("unknown device `{other}` (expected auto, cpu or gpu)")),
        }
    }
}

/// Make `choice` MLX's default device for the whole process, and return the device name that
/// reports will record. Call it before any array exists: MLX keeps one process-wide default,
/// and arrays made earlier stay on the old device's streams.
pub fn use_device(choice: DeviceChoice) -> Result<String, Error> {
    let (kind, name) = match choice {
        DeviceChoice::Auto => return Ok(device()),
        DeviceChoice::Cpu => (mlx_sys::mlx_device_type__MLX_CPU, "cpu"),
        DeviceChoice::Gpu => (mlx_sys::mlx_device_type__MLX_GPU, "gpu"),
    };
    // SAFETY: the device handle is created, queried, installed and freed here; MLX copies it.
    // mlx-rs's Device::set_default drops MLX's status, which is how an unavailable GPU would
    // go unnoticed and the run would silently stay on the CPU.
    unsafe {
        let dev = mlx_sys::mlx_device_new_type(kind, 0);
        let mut available = false;
        let ok = mlx_sys::mlx_device_is_available(&mut available, dev) == 0 && available;
        let set = ok && mlx_sys::mlx_set_default_device(dev) == 0;
        mlx_sys::mlx_device_free(dev);
        if !set {
            return Err(Error::DeviceUnavailable(name));
        }
    }
    Ok(device())
}

/// `gpu` on Apple Silicon with Metal, `cpu` otherwise (or as `use_device` set it).
pub fn device() -> String {
    match Device::try_default().and_then(|d| d.get_type()) {
        Ok(DeviceType::Gpu) => "gpu".into(),
        _ => "cpu".into(),
    }
}

/// MLX's backend for its GPU (`cuda`, `metal`), asked of the library that is loaded: parity's
/// Linux binary is built against the CPU wheel and runs unchanged on the CUDA one.
fn gpu_backend() -> Option<String> {
    let mut cuda = false;
    let mut metal = false;
    // SAFETY: both calls only write the bool they are given.
    unsafe {
        if mlx_sys::mlx_cuda_is_available(&mut cuda) == 0 && cuda {
            return Some("cuda".into());
        }
        if mlx_sys::mlx_metal_is_available(&mut metal) == 0 && metal {
            return Some("metal".into());
        }
    }
    None
}

/// The default device's `device_name` as MLX's `device_info` gives it, where it does.
fn gpu_name() -> Option<String> {
    // SAFETY: the info object and the device handle are created, read and freed here; the
    // name's bytes belong to the info object and are copied before it is freed.
    unsafe {
        let mut dev = mlx_sys::mlx_device_new();
        if mlx_sys::mlx_get_default_device(&mut dev) != 0 {
            mlx_sys::mlx_device_free(dev);
            return None;
        }
        let mut info = mlx_sys::mlx_device_info_new();
        let mut name: *const libc::c_char = std::ptr::null();
        let got = mlx_sys::mlx_device_info_get(&mut info, dev) == 0
            && mlx_sys::mlx_device_info_get_string(&mut name, info, c"device_name".as_ptr()) == 0
            && !name.is_null();
        let out = got.then(|| std::ffi::CStr::from_ptr(name).to_string_lossy().trim().to_string());
        mlx_sys::mlx_device_info_free(info);
        mlx_sys::mlx_device_free(dev);
        out.filter(|n| !n.is_empty())
    }
}

pub fn environment() -> Environment {
    let device = device();
    let gpu = device == "gpu";
    Environment {
        mlx_version: mlx_version(),
        backend: if gpu { gpu_backend() } else { None },
        gpu: if gpu { gpu_name() } else { None },
        device,
        os: std::env::consts::OS.into(),
        arch: std::env::consts::ARCH.into(),
        blas: blas(),
        allocator: allocator(),
        mlx_jit: mlx_jit(),
        mlx_enable_tf32: std::env::var("MLX_ENABLE_TF32").ok(),
        reference_devices: BTreeMap::new(),
    }
}

/// OpenBLAS's configuration and the kernel it picked for this CPU (`OPENBLAS_CORETYPE`
/// overrides it), and what ci/blas/gemv_forward.c forwards when it is in front (its
/// label's "1-12-row GEMM" part says products of 1 to 12 rows read the weights once), or `None`
/// when no OpenBLAS is loaded (macOS uses Accelerate).
///
/// Why it is recorded: OpenBLAS 0.3.21 (Debian 12) does not know newer Xeons (family 6 model
/// 207) and runs its generic `Prescott` kernel on them, 2-3x slower than `SkylakeX`; a bench
/// or a suite time means little without it.
pub fn blas() -> Option<String> {
    let symbol = loaded_symbol;
    let call = |f: *mut libc::c_void| -> Option<String> {
        // SAFETY: both OpenBLAS functions and the shim's label take no argument and return a
        // static C string.
        let get = unsafe { std::mem::transmute::<*mut libc::c_void, extern "C" fn() -> *const libc::c_char>(f) };
        let p = get();
        // SAFETY: non-null pointers from OpenBLAS point to NUL-terminated static strings.
        (!p.is_null()).then(|| unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().trim().to_string())
    };
    let config = call(symbol(c"openblas_get_config")?)?;
    let core = symbol(c"openblas_get_corename").and_then(call);
    let mut blas = match core {
        Some(core) if !config.contains(&core) => format!("{config} (core {core})"),
        _ => config,
    };
    // ci/blas/gemv_forward.c in front of OpenBLAS: decode at batch 1 to 12 runs about 2x
    // faster with it, so a bench or suite time says whether it ran (and whether
    // PARITY_GEMV_FORWARD=0 held it off). The shim words it itself, and ci/bench_mlx_lm.py
    // reads the same words, so a baseline is checked against it too.
    // A shim whose label is unreadable leaves OpenBLAS's own line standing, not no line at all.
    if let Some(label) = symbol(c"parity_blas_shim").and_then(call) {
        blas.push_str(" + ");
        blas.push_str(&label);
    }
    Some(blas)
}

/// The address of `name` in the objects the process has loaded (the BLAS shim's entry points,
/// OpenBLAS's), or `None` where none defines it.
pub(crate) fn loaded_symbol(name: &std::ffi::CStr) -> Option<*mut libc::c_void> {
    // SAFETY: dlsym with RTLD_DEFAULT only looks a name up in the loaded objects.
    let f = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    (!f.is_null()).then_some(f)
}

/// jemalloc's version and whether it keeps freed pages, when the process runs on it (the Linux
/// CLI, src/main.rs); `None` under the system's malloc (tests, macOS, a library user's own
/// program).
pub fn allocator() -> Option<String> {
    type Mallctl =
        unsafe extern "C" fn(*const libc::c_char, *mut libc::c_void, *mut usize, *mut libc::c_void, usize) -> i32;
    let f = loaded_symbol(c"mallctl")?;
    // The `malloc` every library's call resolves to must be the one beside this `mallctl`
    // (the executable's, interposing libc's), or MLX's arrays are still on the system's malloc.
    let object = |p: *mut libc::c_void| {
        let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
        // SAFETY: dladdr only reads the loader's tables; `info` is a valid out-pointer.
        (unsafe { libc::dladdr(p, &mut info) } != 0).then_some(info.dli_fbase)
    };
    let whole_process = loaded_symbol(c"malloc").is_some_and(|m| object(m).is_some() && object(m) == object(f));
    // SAFETY: jemalloc's mallctl has this signature.
    let mallctl = unsafe { std::mem::transmute::<*mut libc::c_void, Mallctl>(f) };
    let read = |name: &std::ffi::CStr, out: *mut libc::c_void, len: usize| {
        let mut len = len;
        // SAFETY: `out` points to `len` writable bytes of the type jemalloc documents for `name`.
        unsafe { mallctl(name.as_ptr(), out, &mut len, std::ptr::null_mut(), 0) == 0 }
    };
    let mut version: *const libc::c_char = std::ptr::null();
    let size = std::mem::size_of_val(&version);
    if !read(c"version", (&raw mut version).cast(), size) || version.is_null() {
        return None;
    }
    // SAFETY: jemalloc's version is a static NUL-terminated string.
    let version = unsafe { std::ffi::CStr::from_ptr(version) }.to_string_lossy().into_owned();
    // How long freed pages stay with the process (`MALLOC_CONF` can change it): never returning
    // them trades memory for prefill speed, so a figure names it.
    let (mut dirty, mut muzzy): (isize, isize) = (0, 0);
    let decay = read(c"opt.dirty_decay_ms", (&raw mut dirty).cast(), size_of::<isize>())
        && read(c"opt.muzzy_decay_ms", (&raw mut muzzy).cast(), size_of::<isize>());
    let short = version.split('-').next().unwrap_or(&version);
    let mut said = Vec::new();
    if decay {
        said.push(format!("page decay {dirty}/{muzzy} ms"));
    }
    if !whole_process {
        said.push("Rust only: MLX on the system's malloc".into());
    }
    Some(if said.is_empty() { format!("jemalloc {short}") } else { format!("jemalloc {short} ({})", said.join(", ")) })
}

/// The flags [`compile_mlx_kernels_for_this_cpu`] adds to MLX's JIT command. Past the target:
/// MLX's `exp` is a template its kernels call out of line (too long for GCC's default inlining
/// budget), through the PLT into libmlx's baseline copy, whose every `fma` is a call into libm;
/// the larger budget inlines it, and `-fno-trapping-math` lets GCC vectorize the loop around its
/// selects (a promise about floating-point exception flags, which no kernel reads: no result
/// changes).
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
const JIT_FLAGS: &str = "-march=x86-64-v3 -ffp-contract=off -fno-trapping-math --param=max-inline-insns-auto=200";
/// The line of the wrapper that says what it adds: [`mlx_jit`] reads it back.
const JIT_MARK: &str = "# parity: MLX's CPU JIT flags: ";

/// On Linux x86_64, MLX's CPU backend fuses the elementwise operations of compiled functions
/// (the SiLU of every MLP, Gemma's GELU) into kernels it builds at run time with `g++ -O3` and
/// nothing else: baseline x86-64, one element at a time, each `fma` a call into libm. Built for
/// the CPU they run on (x86-64-v3: AVX2, FMA), with `exp` inlined and vectorized ([`JIT_FLAGS`]),
/// the same kernels run 10-20x faster (SiLU: 16.8 -> 0.8 ns an element) and give the same bits:
/// `-ffp-contract=off` keeps the compiler from fusing any multiply and add MLX wrote apart,
/// `fma` is exactly rounded whether libm or the CPU computes it, and vectorizing a loop of
/// independent elements changes no element (the SiLU kernel agreed with MLX's build on every
/// one of the 2^32 float inputs).
///
/// MLX offers no flag, so this puts a `g++` in front of the real one on `PATH` that adds the
/// flags, and points `TMPDIR` (where MLX caches the kernels it built, by name only) at a
/// directory of these flags' own, so that no kernel built without them is reused and no other
/// MLX program's cache gets kernels built with them. Children (adapters, servers) inherit both,
/// so a mlx-lm adapter's kernels are built the same way.
///
/// Does nothing when the CPU lacks x86-64-v3, when no `g++` is on `PATH`, when
/// `PARITY_MLX_JIT=baseline` asks for MLX's own flags, or when it is already in place (a parity
/// started by parity); returns what it did not do, for the caller to ignore or print.
///
/// # Safety
///
/// Sets environment variables: call it first thing in `main`, before any thread of the program
/// may read the environment.
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
pub unsafe fn compile_mlx_kernels_for_this_cpu() -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    if std::env::var("PARITY_MLX_JIT").is_ok_and(|v| v == "baseline") {
        return Err("PARITY_MLX_JIT=baseline".into());
    }
    if mlx_jit().is_some() {
        return Ok(());
    }
    let v3 = std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("bmi1")
        && std::arch::is_x86_feature_detected!("bmi2")
        && std::arch::is_x86_feature_detected!("f16c")
        && std::arch::is_x86_feature_detected!("lzcnt")
        && std::arch::is_x86_feature_detected!("movbe");
    if !v3 {
        return Err("the CPU is not x86-64-v3".into());
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    let real = std::env::split_paths(&path).map(|d| d.join("g++")).find(|p| p.is_file()).ok_or("no g++ on PATH")?;
    let real = real.to_str().filter(|r| !r.contains('\'')).ok_or("g++'s path cannot be quoted")?.to_string();
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    // Named after the flags: MLX finds a cached kernel by name alone, so a directory shared with
    // kernels built with other flags would serve those.
    let tag = crate::names::stable_hash(JIT_FLAGS.as_bytes());
    let dir = base.join("parity").join(format!("mlx-jit-x86-64-v3-{:08x}", tag as u32));
    let (bin, tmp) = (dir.join("bin"), dir.join("tmp"));
    let io = |what: &str, e: std::io::Error| format!("{what} in {}: {e}", dir.display());
    std::fs::create_dir_all(&bin).map_err(|e| io("bin", e))?;
    std::fs::create_dir_all(&tmp).map_err(|e| io("tmp", e))?;
    let script = wrapper_script(&real);
    let wrapper = bin.join("g++");
    if std::fs::read_to_string(&wrapper).ok().as_deref() != Some(script.as_str()) {
        // Written aside and renamed: a parity starting beside this one never runs half a script.
        let part = bin.join(format!("g++.{}", std::process::id()));
        std::fs::write(&part, &script).map_err(|e| io("g++", e))?;
        std::fs::set_permissions(&part, std::fs::Permissions::from_mode(0o755)).map_err(|e| io("g++", e))?;
        std::fs::rename(&part, &wrapper).map_err(|e| io("g++", e))?;
    }
    let path = std::env::join_paths(std::iter::once(bin).chain(std::env::split_paths(&path)))
        .map_err(|e| format!("PATH: {e}"))?;
    // SAFETY: the caller guarantees no other thread reads the environment meanwhile.
    unsafe {
        std::env::set_var("PATH", path);
        std::env::set_var("TMPDIR", tmp);
    }
    Ok(())
}

/// The `g++` in front of `real`: [`JIT_MARK`] and the flags, then the build.
///
/// MLX builds a kernel whenever its library is missing from the cache, writing the source and
/// running `g++ ... -o LIB`, then loads LIB; processes that miss it together (a run's workers on
/// a fresh cache, parallel tests) each build it, and one would load a library another was still
/// writing (`dlopen` of half a file fails the operation). So builds of one library run one at a
/// time, under a lock beside it; each writes a file of its own, renamed into place whole, and
/// one that finds the library built skips the build. A failed build is tried once more after a
/// moment: another process may have been rewriting the same source file (the same text) as it
/// was read. Where `flock` is missing the build runs as MLX asked.
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
fn wrapper_script(real: &str) -> String {
    format!(
        r#"#!/bin/sh
{JIT_MARK}{JIT_FLAGS}
out=
prev=
for a in "$@"; do
  [ "$prev" = "-o" ] && out=$a
  prev=$a
done
if [ -z "$out" ] || ! command -v flock >/dev/null 2>&1; then
  exec '{real}' "$@" {JIT_FLAGS}
fi
# MLX's names fill the file system's 255 bytes: the lock and the part get short ones.
dir=$(dirname "$out")
key=$(printf %s "$out" | cksum | cut -d' ' -f1)
part="$dir/.part-$key-$$"
n=$#
prev=
for a in "$@"; do
  if [ "$prev" = "-o" ]; then set -- "$@" "$part"; else set -- "$@" "$a"; fi
  prev=$a
done
shift "$n"
exec 9>"$dir/.lock-$key"
flock 9
[ -s "$out" ] && exit 0
'{real}' "$@" {JIT_FLAGS} || {{ sleep 1; '{real}' "$@" {JIT_FLAGS}; }} || {{ rm -f "$part"; exit 1; }}
mv -f "$part" "$out"
"#
    )
}

/// `g++` and [`JIT_FLAGS`] when the `g++` MLX's CPU JIT runs (the first on
/// `PATH`) is the one [`compile_mlx_kernels_for_this_cpu`] wrote; `None` when MLX builds with
/// its own flags (or not at all: macOS, a GPU).
pub fn mlx_jit() -> Option<String> {
    let path = std::env::var_os("PATH")?;
    let first = std::env::split_paths(&path).map(|d| d.join("g++")).find(|p| p.is_file())?;
    let script = std::fs::read_to_string(first).ok()?;
    let flags = script.lines().find_map(|l| l.strip_prefix(JIT_MARK))?;
    Some(format!("g++ {flags}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::Array;
    use mlx_rs::ops::indexing::IndexOp;

    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * 7919 + seed * 104_729) % 23) as f32 / 11.0 - 1.0).collect()
    }

    /// Floats with every mantissa bit in play (a sum of them rounds at almost every step, so a
    /// reordered sum shows), from a fixed linear congruential sequence.
    fn noisy(n: usize, seed: u64) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    /// `got` against `a @ b` in f64, `a` m x k and `b` k x n as row-major slices, with
    /// `alpha * (a @ b) + beta * c` when `c` is given.
    fn assert_product(
        got: &Array,
        a: &[f32],
        b: &[f32],
        (m, k, n): (usize, usize, usize),
        c: Option<(&[f32], f32, f32)>,
    ) {
        got.eval().unwrap();
        assert_eq!(got.size(), m * n, "shape {:?}", got.shape());
        let got = got.as_slice::<f32>();
        for i in 0..m {
            for j in 0..n {
                let (mut dot, mut mag) = (0f64, 0f64);
                for l in 0..k {
                    let t = a[i * k + l] as f64 * b[l * n + j] as f64;
                    dot += t;
                    mag += t.abs();
                }
                let (alpha, beta, c) = c.map_or((1.0, 0.0, 0.0), |(c, alpha, beta)| (alpha, beta, c[i * n + j]));
                let want = alpha as f64 * dot + beta as f64 * c as f64;
                let err = (got[i * n + j] as f64 - want).abs();
                assert!(
                    err <= 1e-5 * (mag + c.abs() as f64) + 1e-6,
                    "({m}x{k}x{n}) [{i},{j}]: {} vs {want}",
                    got[i * n + j]
                );
            }
        }
    }

    /// Every shape of one-row product MLX's CPU matmul hands to `cblas_sgemm` gives the dot
    /// products. Where ci/blas/gemv_forward.c is loaded (ci/setup puts it in front of
    /// OpenBLAS) these calls are the ones it rewrites as GEMV, and a wrong stride, transpose
    /// flag or an unzeroed output would pass every shape-only check and decode wrong tokens.
    #[test]
    fn one_row_products_through_mlx_are_their_dot_products() {
        // MLX's allocator recycles freed buffers, so outputs land on earlier results (fresh
        // pages are zero): a GEMV that adds into its output when beta == 0 gives twice the
        // product here. Two rounds make sure every case runs on a recycled buffer.
        for round in 0..2 {
            one_row_products(round * 10);
        }
    }

    fn one_row_products(seed: usize) {
        // 1031 x 67: above the shim's 65536-element floor, so every product here is forwarded.
        let (k, n) = (1031, 67);
        let x = values(k, seed + 1);
        let w = values(k * n, seed + 2);
        let xa = Array::from_slice(&x, &[1, k as i32]);
        let wa = Array::from_slice(&w, &[k as i32, n as i32]);
        // x @ W: the decode step's projection with weights stored [in, out].
        assert_product(&xa.matmul(&wa).unwrap(), &x, &w, (1, k, n), None);
        // x @ W^T with W stored [out, in]: B arrives transposed.
        let wt: Vec<f32> = (0..n * k).map(|i| w[(i % k) * n + i / k]).collect();
        let wta = Array::from_slice(&wt, &[n as i32, k as i32]);
        assert_product(&xa.matmul(wta.transpose().unwrap()).unwrap(), &x, &w, (1, k, n), None);
        // W^T @ x^T: one output column (N == 1), and W^T @ x^T from [k, n] storage (A transposed).
        let col = Array::from_slice(&x, &[k as i32, 1]);
        assert_product(&wta.matmul(&col).unwrap(), &wt, &x, (n, k, 1), None);
        assert_product(&wa.transpose().unwrap().matmul(&col).unwrap(), &wt, &x, (n, k, 1), None);
        // alpha * x @ W + beta * c: the output is read, not overwritten.
        let c = values(n, seed + 3);
        let ca = Array::from_slice(&c, &[1, n as i32]);
        let got = mlx_rs::ops::addmm(&ca, &xa, &wa, 2.0, 0.5).unwrap();
        assert_product(&got, &x, &w, (1, k, n), Some((&c, 2.0, 0.5)));
        // A batch of one-row products, each its own matrix: C's rows at a stride.
        let b = 3;
        let xs = values(b * k, seed + 4);
        let ws = values(b * k * n, seed + 5);
        let got = Array::from_slice(&xs, &[b as i32, 1, k as i32])
            .matmul(Array::from_slice(&ws, &[b as i32, k as i32, n as i32]))
            .unwrap();
        got.eval().unwrap();
        for i in 0..b {
            let row = got.index(i as i32);
            assert_product(&row, &xs[i * k..(i + 1) * k], &ws[i * k * n..(i + 1) * k * n], (1, k, n), None);
        }
    }

    /// Products of a few rows by a weight matrix, as a decode step at batch 2 to 12 (or a
    /// prefill chunk of so many tokens) hands them to `cblas_sgemm`, with the weights stored
    /// `[in, out]` (parity's) and `[out, in]` (mlx-lm's `x @ W.T`): the rows
    /// ci/blas/gemv_forward.c sends to its own kernels (2 to 12), and 13, past their limit,
    /// which stay OpenBLAS's. A kernel that mixes up a stride, drops the columns past the last
    /// 16 or a K tail, or reads C when beta is 0 decodes wrong tokens while every shape checks.
    #[test]
    fn few_row_products_through_mlx_are_their_dot_products() {
        // K = 583 ends mid-block (16) and n = 131 mid-vector, and each thread's share of the
        // columns is not a multiple of 16.
        let (k, n) = (583, 131);
        let w = values(k * n, 7);
        let wa = Array::from_slice(&w, &[k as i32, n as i32]);
        let wt: Vec<f32> = (0..n * k).map(|i| w[(i % k) * n + i / k]).collect();
        let wta = Array::from_slice(&wt, &[n as i32, k as i32]);
        for round in 0..2 {
            for m in [2, 3, 8, 9, 12, 13] {
                let x = values(m * k, round * 10 + m);
                let xa = Array::from_slice(&x, &[m as i32, k as i32]);
                let c = values(m * n, round * 10 + m + 1);
                let ca = Array::from_slice(&c, &[m as i32, n as i32]);
                for weights in [&wa, &wta.transpose().unwrap()] {
                    assert_product(&xa.matmul(weights).unwrap(), &x, &w, (m, k, n), None);
                    let got = mlx_rs::ops::addmm(&ca, &xa, weights, 2.0, 0.5).unwrap();
                    assert_product(&got, &x, &w, (m, k, n), Some((&c, 2.0, 0.5)));
                }
            }
        }
    }

    /// Several threads multiplying few-row products at once (MLX's streams, a test harness's
    /// threads) each get their own product: the shim's workers serve one job at a time, and a
    /// second caller that shared them would overwrite the first one's job and return before
    /// its columns were written.
    #[test]
    fn few_row_products_from_several_threads_at_once_are_each_their_own() {
        let (m, k, n) = (3, 577, 257);
        let handles: Vec<_> = (0..4)
            .map(|t| {
                std::thread::spawn(move || {
                    let w = values(k * n, 11 + t);
                    let x = values(m * k, 13 + t);
                    let (wa, xa) =
                        (Array::from_slice(&w, &[k as i32, n as i32]), Array::from_slice(&x, &[m as i32, k as i32]));
                    for _ in 0..20 {
                        assert_product(&xa.matmul(&wa).unwrap(), &x, &w, (m, k, n), None);
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().expect("a thread's products");
        }
    }

    /// With the shim loaded, a row's product does not depend on how many rows share the call:
    /// a sequence decoded next to one other gets the logits it gets next to eleven, and by
    /// weights stored `[in, out]` (parity's) the logits it gets alone.
    #[test]
    fn a_rows_product_is_the_same_alone_and_next_to_2_to_12_rows() {
        if !blas().is_some_and(|b| b.contains("1-12-row GEMM reading the weights once")) {
            return;
        }
        let rows = values(12 * 577, 5);
        for (weights, fewest) in few_row_weights().into_iter().zip([1, 2]) {
            let first = first_row_of(&weights, &rows, fewest);
            for m in fewest + 1..=12 {
                assert_eq!(first_row_of(&weights, &rows, m), first, "row 0 of a {m}-row product");
            }
        }
    }

    /// Products of 13 to 64 rows by weights stored `[in, out]` (a short prompt's prefill) run
    /// in the shim's FMA panels: every output element is one fused multiply-add chain over k in
    /// order, from zero. So a prompt's row gets the same sums next to 12 or 63 others, on an
    /// AVX-512 or an AVX2 core alike. Checked against that chain computed here: a panel that
    /// split a sum, reordered it or rounded a product apart fails.
    #[test]
    fn a_prefill_rows_product_is_one_fused_chain_next_to_13_to_64_rows() {
        if !blas().is_some_and(|b| b.contains("FMA panels")) {
            return;
        }
        let (k, n) = (577, 160);
        let weights = values(n * k, 3);
        let w = Array::from_slice(&weights, &[k as i32, n as i32]);
        let rows = values(64 * k, 5);
        let chain: Vec<u32> =
            (0..n).map(|j| (0..k).fold(0.0f32, |s, q| rows[q].mul_add(weights[q * n + j], s)).to_bits()).collect();
        for m in [13, 14, 29, 40, 63, 64] {
            assert_eq!(first_row_of(&w, &rows, m), chain, "row 0 of a {m}-row product");
        }
    }

    /// Attention's per-head products (queries by the keys transposed, then the softmax by the
    /// values: 1 to 8 rows by an operand under 64 Ki elements) run in the shim on the calling
    /// thread, each output element one fused multiply-add chain over k in order from zero. So a
    /// head's scores are the same bits whether MLX multiplies one query row or several, and on
    /// AVX2 and AVX-512 alike. Checked against that chain at head sizes with and without a tail
    /// past the kernels' eight lanes and key counts on both sides of a multiple of eight: a
    /// kernel that summed the keys' lanes apart, or dropped or repeated a tail key, fails.
    #[test]
    fn attention_products_of_1_to_8_rows_are_one_fused_chain() {
        if !blas().is_some_and(|b| b.contains("(attention's) in one FMA chain")) {
            return;
        }
        for (d, w) in [(64, 192), (64, 37), (13, 9), (128, 7), (256, 129)] {
            let keys = noisy(w * d, 3);
            let queries = noisy(8 * d, 5);
            let k = Array::from_slice(&keys, &[w as i32, d as i32]);
            let scores: Vec<u32> =
                (0..w).map(|j| (0..d).fold(0.0f32, |s, x| queries[x].mul_add(keys[j * d + x], s)).to_bits()).collect();
            let probs = noisy(8 * w, 7);
            let mixed: Vec<u32> =
                (0..d).map(|x| (0..w).fold(0.0f32, |s, j| probs[j].mul_add(keys[j * d + x], s)).to_bits()).collect();
            for m in 1..=8 {
                let q = Array::from_slice(&queries[..m * d], &[m as i32, d as i32]);
                let p = Array::from_slice(&probs[..m * w], &[m as i32, w as i32]);
                let row0 = |y: Array| -> Vec<u32> {
                    let y = y.index(0);
                    y.eval().unwrap();
                    y.as_slice::<f32>().iter().map(|v| v.to_bits()).collect()
                };
                assert_eq!(
                    row0(q.matmul(k.transpose().unwrap()).unwrap()),
                    scores,
                    "scores, head size {d}, {w} keys, {m} rows"
                );
                assert_eq!(row0(p.matmul(&k).unwrap()), mixed, "values, head size {d}, {w} keys, {m} rows");
            }
        }
    }

    /// A 577 x 160 matrix stored `[in, out]` and the same stored `[out, in]`, multiplied
    /// transposed (`x @ W.T`).
    fn few_row_weights() -> [Array; 2] {
        let (k, n) = (577, 160);
        let w = Array::from_slice(&values(n * k, 3), &[k as i32, n as i32]);
        let wt = w.reshape(&[n as i32, k as i32]).unwrap().transpose().unwrap();
        [w, wt]
    }

    /// Row 0 of the product of the first `m` of `rows` by `weights`, as bits.
    fn first_row_of(weights: &Array, rows: &[f32], m: usize) -> Vec<u32> {
        let k = weights.shape()[0] as usize;
        let x = Array::from_slice(&rows[..m * k], &[m as i32, k as i32]);
        let y = x.matmul(weights).unwrap().index(0);
        y.eval().unwrap();
        y.as_slice::<f32>().iter().map(|v| v.to_bits()).collect()
    }

    /// The shim's sums do not depend on how many threads it runs: a K-split product cuts K in
    /// runs fixed by K alone and adds them in one order whichever thread computed each (and a
    /// panel product, 13 to 64 rows, sums each element in one chain whoever runs it), so a
    /// row's logits are the same on a 2-core CI runner and a 16-core workstation. Each thread
    /// count runs in its own child (the shim's pool is sized once, from
    /// `OPENBLAS_NUM_THREADS`, when it starts); a split tied to the thread count fails here.
    #[test]
    fn a_rows_product_is_the_same_on_1_2_and_4_threads() {
        const DUMP: &str = "PARITY_TEST_PRODUCT_BITS";
        let rows = values(64 * 577, 5);
        if std::env::var_os(DUMP).is_some() {
            for (weights, panels) in few_row_weights().into_iter().zip([true, false]) {
                // [out, in] weights go to OpenBLAS past 12 rows: not the shim's to promise.
                let counts: &[usize] = if panels { &[1, 2, 12, 13, 64] } else { &[1, 2, 12] };
                for &m in counts {
                    println!("{DUMP} {m} {:?}", first_row_of(&weights, &rows, m));
                }
            }
            return;
        }
        if !blas().is_some_and(|b| b.contains("1-12-row GEMM reading the weights once")) {
            return;
        }
        let exe = std::env::current_exe().expect("the test binary");
        let name = "environment::tests::a_rows_product_is_the_same_on_1_2_and_4_threads";
        let dump = |threads: u32| -> Vec<String> {
            let out = std::process::Command::new(&exe)
                .args([name, "--exact", "--nocapture", "--test-threads", "1"])
                .env(DUMP, "1")
                .env("OPENBLAS_NUM_THREADS", threads.to_string())
                .output()
                .expect("the test binary runs");
            assert!(out.status.success(), "{threads} threads: {}", String::from_utf8_lossy(&out.stderr));
            // libtest's own "test ... " may precede the first line.
            let stdout = String::from_utf8_lossy(&out.stdout);
            let lines: Vec<String> =
                stdout.lines().filter_map(|l| l.find(DUMP).map(|at| l[at..].to_string())).collect();
            assert_eq!(lines.len(), 8, "{threads} threads printed {} products", lines.len());
            lines
        };
        let one = dump(1);
        for threads in [2, 4] {
            assert_eq!(dump(threads), one, "products on {threads} threads against one");
        }
    }

    /// A GPU result must name what ran it: a CUDA and a Metal report would otherwise read
    /// alike (`gpu`), though their arithmetic differs.
    #[test]
    fn the_device_label_says_what_mlx_said_of_the_gpu() {
        let mut env = Environment {
            mlx_version: "0.32.2".into(),
            device: "cpu".into(),
            backend: None,
            gpu: None,
            os: "linux".into(),
            arch: "x86_64".into(),
            blas: None,
            allocator: None,
            mlx_jit: None,
            mlx_enable_tf32: None,
            reference_devices: BTreeMap::new(),
        };
        assert_eq!(env.device_label(), "cpu");
        env.device = "gpu".into();
        env.backend = Some("cuda".into());
        assert_eq!(env.device_label(), "gpu (cuda)");
        env.gpu = Some("NVIDIA H200".into());
        assert_eq!(env.device_label(), "gpu (cuda, NVIDIA H200)");
    }
}
