//! Chains of elementwise operations compiled into one MLX kernel each, for the places a step
//! runs them on every layer (the RoPE rotation, the MLP's gate, attention's softmax) and the
//! judge on every step it compares (log-softmax, KL).
//!
//! Uncompiled, each operation of such a chain is an MLX operation of its own, a few
//! microseconds of dispatch each on the CPU, and a decode step of a small model is made of
//! them as much as of its weight reads. Compiled, their `exp` is also inlined and vectorized
//! for the host (see `environment::compile_mlx_kernels_for_this_cpu`), where MLX's own
//! softmax and logsumexp kernels call it out of line, one element at a time. Fusing must not move a bit: every committed snapshot
//! and the references were computed unfused. It does not, because a fused kernel performs the
//! same float operations in the same order, each rounded to the operation's dtype, provided
//! the compiler does not contract a multiply and an add into an fma: where parity builds
//! MLX's CPU kernels for the host it passes `-ffp-contract=off`, and MLX's own flags target
//! an ISA without fma. Each fused function has a test holding it bit for bit to its unfused
//! form.

use std::cell::RefCell;

use mlx_rs::Array;
use mlx_rs::error::Exception;

use crate::error::{Error, Result};

/// What mlx-rs's `compile` returns, boxed.
type Compiled = Box<dyn FnMut(&[Array]) -> std::result::Result<Vec<Array>, Exception>>;

/// A compiled function of arrays to one array.
pub(crate) struct Fused(RefCell<Compiled>);

impl Fused {
    /// `f` compiled for the shapes and dtypes it is called with (MLX traces once per distinct
    /// set and keeps them). Held in a thread local for the thread's life: mlx-rs ties a compiled
    /// function to its thread, and one compiled anew on every call is traced anew on every call.
    pub(crate) fn new(f: impl FnMut(&[Array]) -> std::result::Result<Array, Exception> + 'static) -> Self {
        let mut f = f;
        let vec = move |args: &[Array]| Ok(vec![f(args)?]);
        Fused(RefCell::new(Box::new(mlx_rs::transforms::compile::compile(vec, false))))
    }

    pub(crate) fn call(&self, args: &[Array]) -> Result<Array> {
        let out = (self.0.borrow_mut())(args)?;
        out.into_iter().next().ok_or_else(|| Error::Invalid("a fused kernel returned nothing".into()))
    }
}
