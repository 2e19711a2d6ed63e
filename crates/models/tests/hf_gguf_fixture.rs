//! `tiny-llama-f32.gguf` against `tiny-llama/` (HF, BF16): the same model in llama.cpp's
//! layout. Checks the permutation of q/k rows, the `rope_freqs.weight` llama3 factors
//! (recomputed here from the HF config) and that every other tensor is the bf16 value widened.

use std::path::{Path, PathBuf};

use pagoda_models::formats::gguf::{GgufFile, MetadataValue};
use pagoda_models::hf::HfModelDir;
use pagoda_models::weights::TensorSource;
use pagoda_tensor::GgmlType;

fn tiny(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/tiny")
        .join(name)
}

fn f32_values(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn bf16_values(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(2)
        .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
        .collect()
}

/// HF row feeding GGUF row `row` of a q/k weight permuted by llama.cpp's `LlamaModel.permute`:
/// within each head, GGUF row `2i + c` is HF row `c * head_dim / 2 + i`.
fn hf_row_of(row: usize, head_dim: usize) -> usize {
    let (head, within) = (row / head_dim, row % head_dim);
    let (pair, component) = (within / 2, within % 2);
    head * head_dim + component * head_dim / 2 + pair
}

#[test]
fn gguf_fixture_is_the_hf_model_in_llama_cpp_layout() {
    let hf = HfModelDir::open(tiny("tiny-llama")).unwrap();
    let gguf = GgufFile::open(tiny("tiny-llama-f32.gguf")).unwrap();
    let config = &hf.config;
    let as_u64 = |key: &str| match gguf.get(key) {
        Some(MetadataValue::U32(value)) => u64::from(*value),
        Some(MetadataValue::U64(value)) => *value,
        other => panic!("{key}: {other:?}"),
    };
    assert_eq!(as_u64("llama.embedding_length"), config.hidden_size as u64);
    assert_eq!(
        as_u64("llama.attention.head_count_kv"),
        config.num_kv_heads as u64
    );
    assert_eq!(as_u64("llama.rope.dimension_count"), config.head_dim as u64);
    assert_eq!(as_u64("llama.block_count"), config.num_layers as u64);

    let mut checked = 0;
    for name in hf.weights.tensor_names() {
        let hf_tensor = hf.weights.tensor(&name).unwrap();
        let info = gguf
            .tensor(&name)
            .unwrap_or_else(|| panic!("{name} missing from the GGUF"));
        assert_eq!(info.ty, GgmlType::F32, "{name}");
        let reversed: Vec<u64> = hf_tensor.shape.iter().rev().map(|&d| d as u64).collect();
        assert_eq!(info.dims, reversed, "{name}");
        let want = bf16_values(&hf_tensor.data);
        let got = f32_values(gguf.tensor_data(info));
        let columns = *hf_tensor.shape.last().unwrap();
        let permuted = name.ends_with("attn_q.weight") || name.ends_with("attn_k.weight");
        for (row, got_row) in got.chunks(columns).enumerate() {
            let source = if permuted {
                hf_row_of(row, config.head_dim)
            } else {
                row
            };
            assert_eq!(
                got_row,
                &want[source * columns..(source + 1) * columns],
                "{name} row {row}"
            );
        }
        checked += 1;
    }
    assert_eq!(checked, 21);
    assert_eq!(gguf.tensors.len(), checked + 1);

    // llama3 scaling as llama.cpp stores it: divisors of the base frequencies.
    let scaling = config.rope_scaling.unwrap();
    let original = scaling.original_max_position_embeddings as f64;
    let low_freq_wavelength = original / scaling.low_freq_factor as f64;
    let high_freq_wavelength = original / scaling.high_freq_factor as f64;
    let factors = f32_values(gguf.tensor_bytes("rope_freqs.weight").unwrap());
    assert_eq!(factors.len(), config.head_dim / 2);
    for (i, &factor) in factors.iter().enumerate() {
        let frequency = (config.rope_theta as f64).powf(-((2 * i) as f64) / config.head_dim as f64);
        let wavelength = 2.0 * std::f64::consts::PI / frequency;
        let want = if wavelength < high_freq_wavelength {
            1.0
        } else if wavelength > low_freq_wavelength {
            scaling.factor as f64
        } else {
            let smooth = (original / wavelength - scaling.low_freq_factor as f64)
                / (scaling.high_freq_factor - scaling.low_freq_factor) as f64;
            1.0 / ((1.0 - smooth) / scaling.factor as f64 + smooth)
        };
        assert!(
            (factor as f64 - want).abs() < 1e-5 * want,
            "rope_freqs[{i}] = {factor}, want {want}"
        );
    }
    // All three bands occur at these sizes.
    assert_eq!(factors[0], 1.0);
    assert!(factors[1] > 1.0 && factors[1] < 8.0);
    assert_eq!(factors[2], 8.0);
}
