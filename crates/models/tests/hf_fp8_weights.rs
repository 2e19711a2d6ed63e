//! Block-scaled FP8 safetensors (DeepSeek-V3's format): `F8_E4M3` weights with `_scale_inv`
//! block factors, served dequantized to F32 (tiny-deepseek-v3-fp8 from
//! `scripts/fixtures/tiny_deepseek.py`, whose oracle dequantizes in float64), and the errors
//! of a missing or misshapen scale and of other quantization methods.

use std::path::{Path, PathBuf};

use pagoda_models::formats::safetensors::SafetensorsWeights;
use pagoda_models::hf::HfModelDir;
use pagoda_models::weights::TensorSource;
use pagoda_tensor::GgmlType;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tiny/tiny-deepseek-v3-fp8")
}

/// A scratch directory unique to this test process and `name`, emptied first.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pagoda-hf-fp8-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// An independent e4m3 decoder: the value of every code by counting up the positive codes
/// (eight subnormal steps of 2^-9, then eight steps per binade), sign by the top bit.
fn e4m3(byte: u8) -> f64 {
    let code = usize::from(byte & 0x7f);
    let magnitude = if code < 8 {
        code as f64 * 2f64.powi(-9)
    } else {
        let binade = (code / 8) as i32 - 7;
        (1.0 + (code % 8) as f64 / 8.0) * 2f64.powi(binade)
    };
    if byte & 0x80 != 0 {
        -magnitude
    } else {
        magnitude
    }
}

#[test]
fn fp8_projections_are_served_as_f32_products_of_code_and_block_factor() {
    let dir = fixture();
    let hf = HfModelDir::open(&dir).unwrap();
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let mut fp8 = 0;
    for (hf_name, canonical) in [
        (
            "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
            "blk.1.attn_kv_a_mqa.weight",
        ),
        (
            "model.layers.0.mlp.down_proj.weight",
            "blk.0.ffn_down.weight",
        ),
        (
            "model.layers.2.self_attn.q_b_proj.weight",
            "blk.2.attn_q_b.weight",
        ),
    ] {
        let stored = file.tensor(hf_name).unwrap();
        assert_eq!(stored.dtype(), Dtype::F8_E4M3, "{hf_name}");
        let scales = file.tensor(&format!("{hf_name}_scale_inv")).unwrap();
        let factors: Vec<f32> = scales
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let (rows, cols) = (stored.shape()[0], stored.shape()[1]);
        let scale_cols = scales.shape()[1];
        let served = hf.weights.tensor(canonical).unwrap();
        assert_eq!(
            (served.ty, served.shape.clone()),
            (GgmlType::F32, vec![rows, cols])
        );
        for (i, (&code, value)) in stored
            .data()
            .iter()
            .zip(served.data.chunks_exact(4))
            .enumerate()
        {
            let (row, col) = (i / cols, i % cols);
            let factor = factors[(row / 16) * scale_cols + col / 16];
            let expected = (e4m3(code) * f64::from(factor)) as f32;
            let got = f32::from_le_bytes(value.try_into().unwrap());
            assert_eq!(got, expected, "{hf_name} [{row}, {col}]");
        }
        fp8 += 1;
    }
    assert_eq!(fp8, 3);
    // 16 x 16 blocks are narrower than a row: not served as codes with a factor per row.
    assert!(hf.weights.fp8_rows("blk.0.ffn_down.weight").is_none());
    // Every projection of the fixture is FP8; its scales are not served as tensors.
    assert!(
        hf.weights.fp8_tensors() > 20,
        "{}",
        hf.weights.fp8_tensors()
    );
    assert!(
        hf.weights.unmapped_names().is_empty(),
        "{:?}",
        hf.weights.unmapped_names()
    );
    // Norms and the router stay F32 and are served as stored.
    assert_eq!(
        hf.weights.tensor("blk.1.ffn_gate_inp.weight").unwrap().ty,
        GgmlType::F32
    );
}

/// Rewrites the fixture's safetensors into `dir` with `edit` applied to the (name, view)
/// list, and copies the config (`config` edits its JSON text).
fn rewrite(
    dir: &Path,
    edit: impl FnOnce(&mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>),
    config: impl FnOnce(String) -> String,
) {
    let bytes = std::fs::read(fixture().join("model.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = file
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            (
                name,
                view.dtype(),
                view.shape().to_vec(),
                view.data().to_vec(),
            )
        })
        .collect();
    edit(&mut tensors);
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, dtype, shape, data)| {
            (
                name.clone(),
                TensorView::new(*dtype, shape.clone(), data).unwrap(),
            )
        })
        .collect();
    let out = safetensors::serialize(views, None).unwrap();
    std::fs::write(dir.join("model.safetensors"), out).unwrap();
    for name in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(fixture().join(name), dir.join(name)).unwrap();
    }
    let text = std::fs::read_to_string(fixture().join("config.json")).unwrap();
    std::fs::write(dir.join("config.json"), config(text)).unwrap();
}

#[test]
fn a_missing_or_misshapen_scale_is_a_clear_error() {
    let name = "model.layers.1.self_attn.o_proj.weight";
    let dir = scratch("missing");
    rewrite(
        &dir,
        |tensors| tensors.retain(|t| t.0 != format!("{name}_scale_inv")),
        |c| c,
    );
    let error = SafetensorsWeights::open_dir(&dir).unwrap_err().to_string();
    assert!(
        error.contains(name) && error.contains("_scale_inv"),
        "{error}"
    );
    std::fs::remove_dir_all(&dir).unwrap();

    let dir = scratch("misshapen");
    rewrite(
        &dir,
        |tensors| {
            let scale = tensors
                .iter_mut()
                .find(|t| t.0 == format!("{name}_scale_inv"))
                .unwrap();
            // 3 x 2 factors for a 64 x 64 weight fit no power-of-two block height.
            let cells = scale.2.iter().product::<usize>();
            assert!(cells >= 6, "{:?}", scale.2);
            scale.2 = vec![3, 2];
            scale.3.truncate(6 * 4);
        },
        |c| c,
    );
    let error = SafetensorsWeights::open_dir(&dir).unwrap_err().to_string();
    assert!(
        error.contains(name) && error.contains("block size"),
        "{error}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn other_quantization_methods_are_refused_naming_the_field() {
    let dir = scratch("gptq");
    rewrite(&dir, |_| {}, |c| c.replace("\"fp8\"", "\"gptq\""));
    let error = HfModelDir::open(&dir).unwrap_err().to_string();
    assert!(
        error.contains("quantization_config.quant_method") && error.contains("gptq"),
        "{error}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
    let dir = scratch("e5m2");
    rewrite(&dir, |_| {}, |c| c.replace("\"e4m3\"", "\"e5m2\""));
    let error = HfModelDir::open(&dir).unwrap_err().to_string();
    assert!(error.contains("quantization_config.fmt"), "{error}");
    std::fs::remove_dir_all(&dir).unwrap();
}
