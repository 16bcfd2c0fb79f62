//! One server under test: started from the suite's argv template on a free loopback port (or
//! a running one at a loopback `url`), polled until ready, and killed with its whole process
//! group when dropped — on every return path, on Ctrl-C (`proc::install_interrupt_handler`)
//! and, on Linux, when parity dies. Its output goes to a log file in the reports folder and a
//! bounded tail that error messages quote.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::engine::Dirs;
use crate::proc::{self, Child, Spawn, Stdout};
use crate::vocab::{LOOPBACK, OpenaiPath, OpenaiSpec, ServerSpec};

pub struct Server {
    child: Option<Child>,
    /// `http://127.0.0.1:PORT`, no trailing slash.
    pub base: String,
    pub log: Option<PathBuf>,
    started: Instant,
}

/// An HTTP agent that only ever talks to what it is pointed at: no proxy from the
/// environment, no redirects (a redirect could leave loopback), statuses returned as values.
pub fn agent(timeout: Duration) -> ureq::Agent {
    ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        .max_redirects(0)
        .http_status_as_error(false)
        .proxy(None)
        .build()
        .into()
}

/// A port the kernel says is free on loopback right now (bind to 0, read it, let it go). The
/// server binds it a moment later; a collision shows as "exited at start", named.
fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind((LOOPBACK, 0))?.local_addr()?.port())
}

impl Server {
    /// Start `path`'s server and wait until it is ready, or say why not (how it ended and the
    /// tail of its log). The command's placeholders: `{model}` (the suite's `model`, else the
    /// resolved checkpoint), `{checkpoint}`, `{suite_dir}`, `{port}`, `{host}` and `{path}`.
    /// `log`: append the server's output there (created with its directory).
    pub fn start(spec: &OpenaiSpec, path: &OpenaiPath, dirs: Dirs, log: Option<PathBuf>) -> Result<Server, String> {
        let started = Instant::now();
        let (argv, model) = match &spec.server {
            ServerSpec::Url(url) => {
                let server = Server { child: None, base: url.clone(), log: None, started };
                return server.wait_ready(spec, started).map(|mut s| {
                    s.started = Instant::now();
                    s
                });
            }
            ServerSpec::Command { argv, model } => (argv, model),
        };
        let (checkpoint, suite_dir) = dirs.absolute();
        let model = match model {
            Some(m) if Path::new(m).is_absolute() => PathBuf::from(m),
            Some(m) => suite_dir.join(m),
            None => checkpoint.clone(),
        };
        let port = free_port().map_err(|e| format!("no free loopback port: {e}"))?.to_string();
        let (model, checkpoint, suite) =
            (model.display().to_string(), checkpoint.display().to_string(), suite_dir.display().to_string());
        let values = [
            ("model", model.as_str()),
            ("checkpoint", &checkpoint),
            ("suite_dir", &suite),
            ("port", &port),
            ("host", LOOPBACK),
            ("path", &path.name),
        ];
        let argv = crate::engine::command(argv, &path.args, &values, &suite_dir);
        if let Some(log) = &log {
            if let Some(dir) = log.parent() {
                std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
            }
            // One log per server start: a re-run replaces it.
            let _ = std::fs::remove_file(log);
            let _ = std::fs::write(log, format!("# {}\n", argv.join(" ")));
        }
        let child = Child::spawn(&Spawn {
            argv,
            cwd: suite_dir,
            env: Vec::new(),
            stdin: false,
            stdout: Stdout::Log,
            log_file: log.clone(),
        })
        .map_err(|e| e.to_string())?;
        let server = Server { child: Some(child), base: format!("http://{LOOPBACK}:{port}"), log, started };
        server.wait_ready(spec, started)
    }

    fn wait_ready(mut self, spec: &OpenaiSpec, started: Instant) -> Result<Server, String> {
        let probe = agent(Duration::from_secs(5));
        let url = format!("{}{}", self.base, spec.ready);
        loop {
            if let Some(why) = self.ended() {
                return Err(format!("server exited at start: {why}"));
            }
            let last = match probe.get(&url).call() {
                Ok(r) if r.status().as_u16() == 200 => return Ok(self),
                Ok(r) => format!("GET {} answered {}", spec.ready, r.status().as_u16()),
                Err(e) => format!("GET {}: {e}", spec.ready),
            };
            if started.elapsed() > spec.start_timeout {
                return Err(format!(
                    "server not ready within {}s (engine.start_timeout; last: {last}){}",
                    spec.start_timeout.as_secs_f64(),
                    self.tail_block()
                ));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Seconds since the start command ran (start-up time when called right after `start`).
    pub fn age(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// How the server process ended, with its log tail; `None` while it runs (and for a `url`
    /// server, which parity does not own).
    pub fn ended(&mut self) -> Option<String> {
        let child = self.child.as_mut()?;
        let status = child.exited()?;
        // Its last words may still be in the pipe.
        std::thread::sleep(Duration::from_millis(200));
        Some(format!("{}{}", proc::describe_exit(status), self.tail_block()))
    }

    fn tail_block(&self) -> String {
        let tail = self.child.as_ref().map(|c| c.tail()).unwrap_or_default();
        let log = self.log.as_ref().map(|l| format!(" (full log: {})", l.display())).unwrap_or_default();
        if tail.is_empty() { log } else { format!("{log}\nserver output (last lines):\n{tail}") }
    }

    /// After a failed request: give a dying server a moment to be seen dead (the connection
    /// drops before the exit status is reapable), then say how it ended, if it did.
    pub fn ended_after_failure(&mut self) -> Option<String> {
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            if let Some(why) = self.ended() {
                return Some(why);
            }
            // A `url` server is not ours: nothing to wait for.
            self.child.as_ref()?;
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    /// Kill the server's process group now (also done on drop).
    pub fn stop(&mut self) {
        if let Some(c) = self.child.as_mut() {
            c.kill();
        }
    }
}
