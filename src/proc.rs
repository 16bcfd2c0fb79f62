//! Child processes parity starts (engine adapters, servers under test).
//!
//! Invariant: nothing parity starts outlives it. Each child runs in its own process group, so
//! killing the group also kills what the child started (a shell wrapper's python, a server's
//! workers). The group is killed when its [`Child`] is dropped (every return and `?` path),
//! when parity receives SIGINT/SIGTERM/SIGHUP ([`install_interrupt_handler`] kills every live
//! group, then exits 130), and on Linux when parity itself dies without unwinding (the child
//! gets SIGKILL through `PR_SET_PDEATHSIG`, set by `setpriv`: see [`launcher`]).
//!
//! A child's stderr (and its stdout, when that is a log rather than a protocol channel) is
//! drained by a thread into a bounded tail kept for error messages, and optionally into a log
//! file, so a chatty child can never block on a full pipe.

use std::collections::{BTreeSet, VecDeque};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Lines of output kept for error messages.
const TAIL_LINES: usize = 40;
/// A single kept line is cut to this many bytes (a child may print megabytes on one line).
const TAIL_LINE_BYTES: usize = 400;

#[derive(Debug, thiserror::Error)]
pub enum ProcError {
    #[error("cannot start `{program}`: {source}")]
    Spawn { program: String, source: std::io::Error },
    #[error("empty command")]
    EmptyCommand,
    #[error("cannot create log file {path}: {source}")]
    Log { path: PathBuf, source: std::io::Error },
}

/// Where a child's stdout goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stdout {
    /// A protocol channel: read it with [`Child::stdout_lines`].
    Piped,
    /// Output to keep: into the tail and the log file, with stderr.
    Log,
}

/// What to start. `argv[0]` is used as given (resolve it before, see `engine::process`).
#[derive(Debug, Clone)]
pub struct Spawn {
    pub argv: Vec<String>,
    pub cwd: PathBuf,
    pub env: Vec<(String, String)>,
    /// Give the child a stdin pipe (else /dev/null).
    pub stdin: bool,
    pub stdout: Stdout,
    /// Append everything the child logs (stderr, and stdout in `Log` mode) to this file.
    pub log_file: Option<PathBuf>,
}

/// The process groups alive right now, for the interrupt handler.
fn live_groups() -> &'static Mutex<BTreeSet<i32>> {
    static LIVE: OnceLock<Mutex<BTreeSet<i32>>> = OnceLock::new();
    LIVE.get_or_init(|| Mutex::new(BTreeSet::new()))
}

fn kill_group(pgid: i32, signal: i32) {
    // SAFETY: kill(2) with a negative pid signals a process group; no memory is involved.
    unsafe {
        libc::kill(-pgid, signal);
    }
}

/// Kill every child group parity started and exit 130 on SIGINT, SIGTERM or SIGHUP. Idempotent.
pub fn install_interrupt_handler() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        let _ = ctrlc::set_handler(|| {
            kill_all();
            eprintln!("\ninterrupted: stopped every engine process parity started");
            std::process::exit(130);
        });
    });
}

/// Kill every live child group (interrupt handler, and fatal exits).
pub fn kill_all() {
    let groups: Vec<i32> = live_groups().lock().map(|g| g.iter().copied().collect()).unwrap_or_default();
    for pgid in groups {
        kill_group(pgid, libc::SIGKILL);
    }
}

/// The last lines a child printed, bounded.
#[derive(Debug, Default)]
struct Tail {
    lines: VecDeque<String>,
    /// The child's output reached EOF: every line it wrote is in `lines`.
    closed: bool,
}

impl Tail {
    fn push(&mut self, line: &str) {
        let mut line = line.trim_end().to_string();
        if line.len() > TAIL_LINE_BYTES {
            let mut cut = TAIL_LINE_BYTES;
            while !line.is_char_boundary(cut) {
                cut -= 1;
            }
            line.truncate(cut);
            line.push_str(" [...]");
        }
        if self.lines.len() == TAIL_LINES {
            self.lines.pop_front();
        }
        self.lines.push_back(line);
    }
}

pub struct Child {
    inner: std::process::Child,
    pgid: i32,
    tail: Arc<Mutex<Tail>>,
    stdin: Option<ChildStdin>,
    stdout: Option<std::process::ChildStdout>,
    exited: Option<ExitStatus>,
}

impl Child {
    pub fn spawn(spec: &Spawn) -> Result<Child, ProcError> {
        let program = spec.argv.first().ok_or(ProcError::EmptyCommand)?.clone();
        let (launch, prefix) = launcher(&program, spec)?;
        let mut cmd = Command::new(&launch);
        cmd.args(&prefix)
            .args(&spec.argv[1..])
            .current_dir(&spec.cwd)
            .envs(spec.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(if spec.stdin { Stdio::piped() } else { Stdio::null() })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        use std::os::unix::process::CommandExt;
        // No `pre_exec` hook, ever: it makes std `fork` instead of `posix_spawn` (see
        // `launcher`). A process group is something posix_spawn can set.
        cmd.process_group(0);
        let log = match &spec.log_file {
            Some(path) => Some(Arc::new(Mutex::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .map_err(|source| ProcError::Log { path: path.clone(), source })?,
            ))),
            None => None,
        };
        // Register before the child can be interrupted unregistered; the pid is known only
        // after spawn, so hold the lock across it.
        let mut live = live_groups().lock().unwrap_or_else(|e| e.into_inner());
        let mut inner = cmd.spawn().map_err(|source| ProcError::Spawn { program: program.clone(), source })?;
        let pgid = inner.id() as i32;
        live.insert(pgid);
        drop(live);

        let tail = Arc::new(Mutex::new(Tail::default()));
        if let Some(err) = inner.stderr.take() {
            drain(err, tail.clone(), log.clone());
        }
        let stdout = inner.stdout.take();
        let stdout = match spec.stdout {
            Stdout::Piped => stdout,
            Stdout::Log => {
                if let Some(out) = stdout {
                    drain(out, tail.clone(), log.clone());
                }
                None
            }
        };
        let stdin = inner.stdin.take();
        Ok(Child { inner, pgid, tail, stdin, stdout, exited: None })
    }

    /// Send one line (a newline is appended) to the child's stdin.
    pub fn send_line(&mut self, line: &str) -> std::io::Result<()> {
        let stdin = self
            .stdin
            .as_mut()
            .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "stdin is closed"))?;
        stdin.write_all(line.as_bytes())?;
        stdin.write_all(b"\n")?;
        stdin.flush()
    }

    /// Close the child's stdin (an adapter treats EOF as shutdown).
    pub fn close_stdin(&mut self) {
        self.stdin = None;
    }

    /// The child's stdout as a channel of lines, read by a thread (so a caller can wait with a
    /// timeout). `None` after the first call or in `Log` mode. The channel closes at EOF.
    pub fn stdout_lines(&mut self) -> Option<Receiver<std::io::Result<String>>> {
        let out = self.stdout.take()?;
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(out);
            loop {
                let mut line = String::new();
                match reader.read_line(&mut line) {
                    Ok(0) => return,
                    Ok(_) => {
                        if tx.send(Ok(line)).is_err() {
                            return;
                        }
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e));
                        return;
                    }
                }
            }
        });
        Some(rx)
    }

    /// The last lines the child logged, oldest first.
    pub fn tail(&self) -> String {
        let tail = self.tail.lock().unwrap_or_else(|e| e.into_inner());
        tail.lines.iter().cloned().collect::<Vec<_>>().join("\n")
    }

    /// The last lines, once the child's output has been read to its end or `within` has
    /// passed. A child that prints why it fails and dies at once can exit before its drain
    /// thread reads those words; without this wait the message would lose them (seen under
    /// load in tests/engines.rs, crash mode).
    pub fn settled_tail(&self, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            let closed = self.tail.lock().map(|t| t.closed).unwrap_or(true);
            if closed || Instant::now() >= deadline {
                return self.tail();
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The exit status if the child has exited (without blocking).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        if self.exited.is_none() {
            self.exited = self.inner.try_wait().ok().flatten();
        }
        self.exited
    }

    /// Wait up to `grace` for the child to exit on its own, then kill its group.
    pub fn stop(&mut self, grace: Duration) {
        let deadline = Instant::now() + grace;
        while self.exited().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
    }

    /// Kill the whole group now and reap the child. Idempotent.
    pub fn kill(&mut self) {
        self.stdin = None;
        // The group may hold processes after the leader exited (a server's workers): kill it
        // even when the child itself is gone.
        kill_group(self.pgid, libc::SIGKILL);
        if self.exited.is_none() {
            self.exited = self.inner.wait().ok();
        }
        if let Ok(mut live) = live_groups().lock() {
            live.remove(&self.pgid);
        }
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Read `from` line by line into `tail` (and `log`) until EOF, on a thread.
fn drain(from: impl Read + Send + 'static, tail: Arc<Mutex<Tail>>, log: Option<Arc<Mutex<std::fs::File>>>) {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(from);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            match reader.read_until(b'\n', &mut buf) {
                Ok(0) | Err(_) => {
                    if let Ok(mut t) = tail.lock() {
                        t.closed = true;
                    }
                    return;
                }
                Ok(_) => {
                    if let Some(log) = &log
                        && let Ok(mut f) = log.lock()
                    {
                        let _ = f.write_all(&buf);
                    }
                    let line = String::from_utf8_lossy(&buf);
                    if let Ok(mut t) = tail.lock() {
                        t.push(&line);
                    }
                }
            }
        }
    });
}

/// What to execute for `program`: the program itself, or on Linux util-linux's `setpriv` with
/// the arguments that make it set the parent-death signal and exec the program.
///
/// Why not `prctl(PR_SET_PDEATHSIG)` in a `pre_exec` hook: any hook makes std start the child
/// with `fork`, `fork` runs every `pthread_atfork` handler, and OpenBLAS's handler
/// (`blas_thread_shutdown_`) deadlocks when another thread of the process is inside a BLAS
/// call (OpenMathLib/OpenBLAS#2270). parity computes with MLX (OpenBLAS on Linux) in one thread
/// while starting adapters in another; that hung CI for 90 minutes
/// (`children_start_while_another_thread_multiplies_matrices` below). Without hooks std uses `posix_spawn`, which runs no
/// fork handlers. The program is resolved here so a missing one is still a spawn error naming
/// it, not a message from setpriv. Where `setpriv` is not installed, children still die with
/// their group on every unwinding exit and on SIGINT/SIGTERM/SIGHUP, only not on SIGKILL.
fn launcher(program: &str, spec: &Spawn) -> Result<(PathBuf, Vec<String>), ProcError> {
    #[cfg(target_os = "linux")]
    {
        static SETPRIV: OnceLock<Option<PathBuf>> = OnceLock::new();
        let setpriv = SETPRIV.get_or_init(|| find_program("setpriv", None, Path::new("/")));
        if let Some(setpriv) = setpriv {
            let path = spec.env.iter().find(|(k, _)| k == "PATH").map(|(_, v)| v.as_str());
            let resolved = find_program(program, path, &spec.cwd).ok_or_else(|| ProcError::Spawn {
                program: program.to_string(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such executable file"),
            })?;
            let prefix = vec!["--pdeathsig".to_string(), "KILL".into(), "--".into(), resolved.display().to_string()];
            return Ok((setpriv.clone(), prefix));
        }
    }
    let _ = spec;
    Ok((PathBuf::from(program), Vec::new()))
}

/// `program` as the kernel would run it: a path (relative to `cwd`) if it has a `/`, else the
/// first executable file of that name on `path` (default: parity's own `PATH`).
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
fn find_program(program: &str, path: Option<&str>, cwd: &Path) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let executable = |p: &Path| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
    if program.contains('/') {
        let p = cwd.join(program);
        return executable(&p).then_some(p);
    }
    let path = path.map(std::ffi::OsString::from).or_else(|| std::env::var_os("PATH"))?;
    std::env::split_paths(&path).map(|dir| cwd.join(dir).join(program)).find(|p| executable(p))
}

/// Describe how a child ended, for error messages: `exited with status 3`, `killed by signal 9`.
pub fn describe_exit(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(sig)) => format!("killed by signal {sig}"),
        _ => "ended".to_string(),
    }
}

/// Resolve a command's program: a name with a `/` is relative to `base` (a suite's directory),
/// a bare name is left for `PATH` lookup.
pub fn resolve_program(program: &str, base: &Path) -> String {
    if program.contains('/') && !Path::new(program).is_absolute() {
        base.join(program).display().to_string()
    } else {
        program.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spawn(argv: &[&str], stdout: Stdout) -> Child {
        Child::spawn(&Spawn {
            argv: argv.iter().map(|s| s.to_string()).collect(),
            cwd: std::env::temp_dir(),
            env: Vec::new(),
            stdin: true,
            stdout,
            log_file: None,
        })
        .expect("spawn")
    }

    fn alive(pid: i32) -> bool {
        // SAFETY: signal 0 only checks that the process exists.
        unsafe { libc::kill(pid, 0) == 0 }
    }

    /// Guards the leak the design forbids: a child's own children (a wrapper script's python)
    /// must die with it when parity drops the handle.
    #[test]
    fn dropping_a_child_kills_its_whole_group() {
        let mut c = spawn(&["sh", "-c", "sleep 30 & echo $!; wait"], Stdout::Piped);
        let lines = c.stdout_lines().expect("stdout");
        let grandchild: i32 =
            lines.recv_timeout(Duration::from_secs(10)).expect("line").expect("io").trim().parse().expect("pid");
        assert!(alive(grandchild));
        drop(c);
        let deadline = Instant::now() + Duration::from_secs(5);
        // A killed grandchild is reparented and reaped by init; until then it is a zombie,
        // which kill(0) still reports: check /proc's state where it exists.
        while Instant::now() < deadline {
            let state = std::fs::read_to_string(format!("/proc/{grandchild}/stat")).ok();
            let zombie_or_gone = state.as_deref().is_none_or(|s| s.split(' ').nth(2) == Some("Z"));
            if zombie_or_gone || !alive(grandchild) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("grandchild {grandchild} outlived its dropped parent");
    }

    #[test]
    fn tail_keeps_the_last_lines_of_stderr() {
        let mut c = spawn(&["sh", "-c", "for i in $(seq 1 100); do echo line$i >&2; done; exit 3"], Stdout::Piped);
        let deadline = Instant::now() + Duration::from_secs(10);
        while c.exited().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let status = c.exited().expect("exited");
        assert_eq!(describe_exit(status), "exited with status 3");
        // The drain thread may lag the exit by a moment.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !c.tail().ends_with("line100") && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let tail = c.tail();
        assert!(tail.ends_with("line100"), "{tail}");
        assert_eq!(tail.lines().count(), TAIL_LINES);
        assert!(!tail.contains("line60\n"), "{tail}");
    }

    #[test]
    fn a_missing_program_is_a_spawn_error_naming_it() {
        let err = Child::spawn(&Spawn {
            argv: vec!["/nonexistent/adapter".into()],
            cwd: std::env::temp_dir(),
            env: Vec::new(),
            stdin: true,
            stdout: Stdout::Piped,
            log_file: None,
        })
        .err()
        .expect("error");
        assert!(err.to_string().contains("/nonexistent/adapter"), "{err}");
    }

    #[test]
    fn relative_programs_resolve_against_the_suite_dir() {
        let base = Path::new("/suites");
        assert_eq!(resolve_program("../ci/mlx-lm", base), "/suites/../ci/mlx-lm");
        assert_eq!(resolve_program("python3", base), "python3");
        assert_eq!(resolve_program("/usr/bin/env", base), "/usr/bin/env");
    }

    /// Guards the CI hang of the step-protocol tests: a child spawned with `fork` while another
    /// thread of the same process is inside an OpenBLAS call can deadlock in OpenBLAS's fork
    /// handler (OpenMathLib/OpenBLAS#2270: `blas_thread_shutdown_` runs at every fork). parity
    /// computes with MLX (OpenBLAS on Linux) in one thread while it starts adapters and servers
    /// in another (tests do it all the time; so does a library user), so children must be
    /// started without running fork handlers.
    #[test]
    fn children_start_while_another_thread_multiplies_matrices() {
        use std::sync::atomic::{AtomicBool, Ordering};
        crate::environment::use_device(crate::environment::DeviceChoice::Cpu).expect("the CPU is always there");
        let stop = Arc::new(AtomicBool::new(false));
        let busy = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let a = mlx_rs::random::normal::<f32>(&[384, 384], None, None, None).expect("normal");
                while !stop.load(Ordering::Relaxed) {
                    let c = a.matmul(&a).expect("matmul");
                    c.eval().expect("eval");
                }
            })
        };
        let (done, finished) = mpsc::channel();
        std::thread::spawn(move || {
            for _ in 0..300 {
                let mut child = spawn(&["true"], Stdout::Log);
                child.stop(Duration::from_secs(5));
            }
            let _ = done.send(());
        });
        let outcome = finished.recv_timeout(Duration::from_secs(120));
        stop.store(true, Ordering::Relaxed);
        assert!(outcome.is_ok(), "spawning children while MLX computes hung (fork handlers deadlocked)");
        busy.join().expect("compute thread");
    }
}
