//! Running one schedule: a thread per request, each waiting for its start condition (another
//! request's streamed token count, or its end) before it sends. A request that fails still
//! counts as ended, so nothing waits forever on it.

use std::sync::{Condvar, Mutex};

use super::client::{Client, Completion, RequestError};
use super::{CompletionRequest, When};

#[derive(Default, Clone, Copy)]
struct Progress {
    tokens: usize,
    done: bool,
}

struct Board {
    state: Mutex<Vec<Progress>>,
    changed: Condvar,
}

impl Board {
    fn update(&self, i: usize, f: impl FnOnce(&mut Progress)) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut s[i]);
        self.changed.notify_all();
    }

    fn wait(&self, when: When) {
        let ready = |s: &Vec<Progress>| match when {
            When::Now => true,
            When::AfterTokens { of, tokens } => s.get(of).is_none_or(|p| p.done || p.tokens >= tokens),
            When::AfterDone { of } => s.get(of).is_none_or(|p| p.done),
        };
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        while !ready(&s) {
            s = self.changed.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Send every request of a schedule as it says; answers in request order.
pub(super) fn run(client: &Client, requests: &[CompletionRequest]) -> Vec<Result<Completion, RequestError>> {
    let board = Board { state: Mutex::new(vec![Progress::default(); requests.len()]), changed: Condvar::new() };
    std::thread::scope(|scope| {
        let handles: Vec<_> = requests
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let board = &board;
                scope.spawn(move || {
                    board.wait(r.when);
                    let mut on_token = |n: usize| board.update(i, |p| p.tokens = n);
                    let out = client.complete(&r.ids, r.max_tokens, r.stream, &mut on_token);
                    board.update(i, |p| p.done = true);
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(RequestError::Transport("the request thread panicked".into()))))
            .collect()
    })
}
