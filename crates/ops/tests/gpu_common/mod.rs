//! Shared helpers of the GPU op tests: the gate, random data, dtype conversions and
//! comparisons with per-dtype tolerances.

#![allow(dead_code)]

pub mod decode_batch;
pub mod fp8;
pub mod prefill_batch;
pub mod sampling;

use half::bf16;
use pagoda_cuda::{DeviceBuffer, Element, Gpu};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The GPU. The tests that call it are `#[ignore = "needs a GPU"]`: `cargo test` lists them
/// as ignored on a machine without one; the GPU machine runs them with `--include-ignored`
/// (a build with `--features cuda`), where a missing GPU fails them.
pub fn gpu() -> Gpu {
    Gpu::new(0).unwrap_or_else(|error| {
        panic!("this test needs a GPU and a build with --features cuda: {error}")
    })
}

/// Deterministic generator per test.
pub fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// `len` values uniform in `[-scale, scale)`.
pub fn random_vec(rng: &mut ChaCha8Rng, len: usize, scale: f32) -> Vec<f32> {
    (0..len).map(|_| rng.random_range(-scale..scale)).collect()
}

/// Float element types under test, with conversions and tolerances.
pub trait TestFloat: Element + std::fmt::Debug {
    /// Rounds an f32 to this type.
    fn from_f32(value: f32) -> Self;
    /// Widens to f32.
    fn to_f32(self) -> f32;
    /// Absolute + relative tolerance for ops computed in f32 and stored in this type.
    const TOLERANCE: f32;
    /// Name for messages.
    const NAME: &'static str;
}

impl TestFloat for f32 {
    fn from_f32(value: f32) -> Self {
        value
    }
    fn to_f32(self) -> f32 {
        self
    }
    const TOLERANCE: f32 = 2e-5;
    const NAME: &'static str = "f32";
}

impl TestFloat for bf16 {
    fn from_f32(value: f32) -> Self {
        bf16::from_f32(value)
    }
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    const TOLERANCE: f32 = 1.6e-2;
    const NAME: &'static str = "bf16";
}

impl TestFloat for half::f16 {
    fn from_f32(value: f32) -> Self {
        half::f16::from_f32(value)
    }
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
    const TOLERANCE: f32 = 2e-3;
    const NAME: &'static str = "f16";
}

/// Rounds every value through `T` (what the GPU sees as input).
pub fn round<T: TestFloat>(values: &[f32]) -> Vec<f32> {
    values.iter().map(|&v| T::from_f32(v).to_f32()).collect()
}

/// Uploads `values` rounded to `T`.
pub fn upload<T: TestFloat>(gpu: &Gpu, values: &[f32]) -> DeviceBuffer<T> {
    let host: Vec<T> = values.iter().map(|&v| T::from_f32(v)).collect();
    gpu.upload(&host).expect("upload")
}

/// A `len`-element output buffer poisoned with 0xFF bytes (NaN for floats).
pub fn poisoned<T: Element>(gpu: &Gpu, len: usize) -> DeviceBuffer<T> {
    let mut buffer = gpu.alloc::<T>(len).expect("alloc");
    gpu.fill_bytes(&mut buffer, 0xFF).expect("poison");
    buffer
}

/// Downloads and widens to f32.
pub fn download<T: TestFloat>(gpu: &Gpu, buffer: &DeviceBuffer<T>) -> Vec<f32> {
    gpu.download(buffer)
        .expect("download")
        .into_iter()
        .map(T::to_f32)
        .collect()
}

/// Asserts `|actual - expected| <= tolerance * (1 + |expected|)` everywhere (NaN fails).
pub fn assert_close(what: &str, actual: &[f32], expected: &[f32], tolerance: f32) {
    assert_eq!(actual.len(), expected.len(), "{what}: lengths differ");
    let mut worst = (0usize, 0f32);
    for (index, (&a, &e)) in actual.iter().zip(expected).enumerate() {
        let error = (a - e).abs() / (1.0 + e.abs());
        assert!(
            !error.is_nan(),
            "{what}: NaN at {index} (actual {a}, expected {e})"
        );
        if error > worst.1 {
            worst = (index, error);
        }
    }
    let (index, error) = worst;
    assert!(
        error <= tolerance,
        "{what}: error {error:e} > {tolerance:e} at {index}: actual {} expected {}",
        actual[index],
        expected[index]
    );
}
