//! A tiny seeded random stream, identical on every machine: integer arithmetic only, so a seed
//! gives the same fixture weights and the same `parity explore` schedules on macOS and Linux,
//! today and after a toolchain update.

/// splitmix64.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// A stream seeded from text (a seed and the names of what it is for), so each use of one
    /// seed gets its own independent stream.
    pub fn from_parts(parts: &[&str]) -> Self {
        Rng(hash(parts.join("\u{1f}").as_bytes()))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n` > 0; 0 when it is not).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 { 0 } else { (self.next_u64() % n as u64) as usize }
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64) < p
    }

    /// One of `items`, `None` when there are none.
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> Option<&'a T> {
        (!items.is_empty()).then(|| &items[self.below(items.len())])
    }

    /// Approximately N(0, 1): the sum of four uniforms, centred and scaled (Irwin-Hall).
    pub fn normal(&mut self) -> f32 {
        let sum: f64 = (0..4).map(|_| (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64).sum();
        ((sum - 2.0) * 3f64.sqrt()) as f32
    }
}

/// FNV-1a: a stable 64-bit hash of bytes (std's hashers may change between releases).
pub fn hash(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100000001b3))
}
