//! Running one schedule: a thread per request, each waiting for its start condition (another
//! request's streamed token count, or its end) before it sends. A request that fails still
//! counts as ended, so nothing waits forever on it.

use std::sync::{Condvar, Mutex};
use std::time::Instant;

use super::client::{Client, RequestError};
use super::{CompletionRequest, Reply, Sent, When};

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
pub(super) fn run(client: &Client, requests: &[CompletionRequest]) -> Vec<Reply> {
    let board = Board { state: Mutex::new(vec![Progress::default(); requests.len()]), changed: Condvar::new() };
    let start = Instant::now();
    std::thread::scope(|scope| {
        let handles: Vec<_> = requests
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let board = &board;
                scope.spawn(move || {
                    board.wait(r.when);
                    let mut first_token = None;
                    let mut on_token = |n: usize| {
                        first_token.get_or_insert_with(|| start.elapsed().as_secs_f64());
                        board.update(i, |p| p.tokens = n)
                    };
                    let at = start.elapsed().as_secs_f64();
                    let result = client.complete(&r.ids, r.max_tokens, r.stream, &mut on_token);
                    let answered = start.elapsed().as_secs_f64();
                    board.update(i, |p| p.done = true);
                    let first_token = first_token.filter(|_| r.stream);
                    Reply { result, sent: Sent { at, first_token, answered } }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| Reply {
                    result: Err(RequestError::Transport("the request thread panicked".into())),
                    sent: Sent::default(),
                })
            })
            .collect()
    })
}
