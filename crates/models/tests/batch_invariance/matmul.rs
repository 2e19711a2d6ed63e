//! The linear layers: a row of `Weight::matmul` must not depend on how many rows share the
//! call.

use pagoda_ops::linear::Weight;
use pagoda_tensor::GgmlType;

use super::default_model::default_model_file;

/// Deterministic pseudo-random values in [-1, 1).
fn values(seed: u64, count: usize) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..count)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// Q4_1 / Q8_0 blocks of 32 built by hand from pseudo-random scales and quants.
fn synthetic_weight(ty: GgmlType, rows: usize, cols: usize) -> Weight {
    let blocks = rows * cols / 32;
    let randoms = values(rows as u64 + (ty == GgmlType::Q8_0) as u64, blocks * 34);
    let f16 = |value: f32| half::f16::from_f32(value).to_bits().to_le_bytes();
    let mut bytes = Vec::new();
    for block in 0..blocks {
        let r = &randoms[block * 34..(block + 1) * 34];
        match ty {
            GgmlType::Q8_0 => {
                bytes.extend(f16(0.01 + 0.01 * r[0].abs()));
                bytes.extend(r[2..34].iter().map(|v| ((v * 127.0) as i8) as u8));
            }
            GgmlType::Q4_1 => {
                bytes.extend(f16(0.02 + 0.02 * r[0].abs()));
                bytes.extend(f16(-0.1 * r[1].abs()));
                bytes.extend(r[2..18].iter().map(|v| (v.abs() * 255.0) as u8));
            }
            _ => unreachable!(),
        }
    }
    Weight::new(ty, rows, cols, bytes).unwrap()
}

/// `true` when every row of `matmul` over T rows equals `matmul` of that row alone, for every
/// T checked; prints the first mismatch.
fn rows_independent_of_batch(name: &str, weight: &Weight) -> bool {
    let (rows, cols) = (weight.out_features(), weight.in_features());
    let x = values(11, 67 * cols);
    let single: Vec<Vec<f32>> = x
        .chunks(cols)
        .map(|row| {
            let mut y = vec![0.0; rows];
            weight.matmul(row, 1, &mut y);
            y
        })
        .collect();
    for num_tokens in [2, 3, 4, 5, 8, 13, 16, 33, 67] {
        let mut y = vec![0.0; num_tokens * rows];
        weight.matmul(&x[..num_tokens * cols], num_tokens, &mut y);
        for (token, got) in y.chunks(rows).enumerate() {
            let differing = got
                .iter()
                .zip(&single[token])
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            if differing > 0 {
                eprintln!(
                    "{name} ({:?}, [{rows}, {cols}]): row {token} of a {num_tokens}-row matmul differs from the 1-row matmul in {differing} of {rows} outputs",
                    weight.ty()
                );
                return false;
            }
        }
    }
    eprintln!("{name} ({:?}): rows independent of the batch", weight.ty());
    true
}

/// Fails today: the T = 1 and T > 1 kernels (and the 4-row f32 tiles) sum in different
/// orders. Un-ignore once the linear kernels keep rows independent of the row count.
#[test]
fn matmul_rows_do_not_depend_on_the_number_of_rows() {
    if !pagoda_ops::linear::batch_invariant() {
        eprintln!(
            "SKIP: prefills run on the AMX-BF16 tiles (PAGODA_CPU_AMX_PREFILL=int8 runs this test)"
        );
        return;
    }
    let mut weights = vec![
        ("synthetic", synthetic_weight(GgmlType::Q4_1, 96, 576)),
        ("synthetic", synthetic_weight(GgmlType::Q8_0, 96, 576)),
    ];
    let f32_weight = weights[0].1.to_f32();
    weights.push(("synthetic", f32_weight));
    if let Some(file) = default_model_file() {
        for name in [
            "blk.0.attn_q.weight",
            "blk.0.ffn_down.weight",
            "token_embd.weight",
        ] {
            let info = file.tensor(name).unwrap();
            let (cols, rows) = (info.dims[0] as usize, info.dims[1] as usize);
            let rows_kept = rows.min(512);
            let row_bytes = file.tensor_data(info).len() / rows;
            let bytes = file.tensor_data(info)[..rows_kept * row_bytes].to_vec();
            let weight = Weight::new(info.ty, rows_kept, cols, bytes).unwrap();
            let as_f32 = weight.to_f32();
            weights.push((name, weight));
            weights.push((name, as_f32));
        }
    }
    let failures: Vec<String> = weights
        .iter()
        .filter(|(name, weight)| !rows_independent_of_batch(name, weight))
        .map(|(name, weight)| format!("{name} {:?}", weight.ty()))
        .collect();
    assert!(
        failures.is_empty(),
        "matmul rows depend on the batch size for: {failures:?}"
    );
}
