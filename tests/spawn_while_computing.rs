//! Guards the CI hang of the step-protocol tests: a child spawned with `fork` while another
//! thread of the same process is inside an OpenBLAS call can deadlock in OpenBLAS's fork
//! handler (OpenMathLib/OpenBLAS#2270: `blas_thread_shutdown_` runs at every fork). parity
//! computes with MLX (OpenBLAS on Linux) in one thread while it starts adapters and servers
//! in another (tests do it all the time; so does a library user), so children must be
//! started without running fork handlers.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use mlx_rs::Array;
use parity::proc::{Child, Spawn, Stdout};

#[test]
fn children_start_while_another_thread_multiplies_matrices() {
    common::cpu();
    let stop = Arc::new(AtomicBool::new(false));
    let busy = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let a = mlx_rs::random::normal::<f32>(&[384, 384], None, None, None).expect("normal");
            while !stop.load(Ordering::Relaxed) {
                let c: Array = a.matmul(&a).expect("matmul");
                c.eval().expect("eval");
            }
        })
    };
    let (done, finished) = mpsc::channel();
    std::thread::spawn(move || {
        for _ in 0..300 {
            let mut child = Child::spawn(&Spawn {
                argv: vec!["true".into()],
                cwd: std::env::temp_dir(),
                env: Vec::new(),
                stdin: false,
                stdout: Stdout::Log,
                log_file: None,
            })
            .expect("spawn true");
            child.stop(Duration::from_secs(5));
        }
        let _ = done.send(());
    });
    let outcome = finished.recv_timeout(Duration::from_secs(120));
    stop.store(true, Ordering::Relaxed);
    assert!(outcome.is_ok(), "spawning children while MLX computes hung (fork handlers deadlocked)");
    busy.join().expect("compute thread");
}
