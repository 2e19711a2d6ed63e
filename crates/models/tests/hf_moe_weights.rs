//! Mixture-of-experts HF checkpoints: per-expert tensors served stacked under GGUF's
//! `ffn_{gate,up,down}_exps` names (tiny-qwen3-moe, tiny-mixtral from
//! `scripts/fixtures/tiny_models.py`), and the errors of incomplete or mismatched experts.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use pagoda_models::formats::safetensors::SafetensorsWeights;
use pagoda_models::hf::HfModelDir;
use pagoda_models::weights::TensorSource;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

fn tiny(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/tiny")
        .join(name)
}

/// A scratch directory unique to this test process and `name`, emptied first.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pagoda-hf-moe-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn per_expert_tensors_are_served_stacked_in_expert_order() {
    for (fixture, expert, parts) in [
        (
            "tiny-qwen3-moe",
            "model.layers.2.mlp.experts.{e}.{part}.weight",
            ["gate_proj", "up_proj", "down_proj"],
        ),
        (
            "tiny-mixtral",
            "model.layers.1.block_sparse_moe.experts.{e}.{part}.weight",
            ["w1", "w3", "w2"],
        ),
    ] {
        let dir = tiny(fixture);
        let hf = HfModelDir::open(&dir).unwrap();
        let moe = hf.config.moe.clone().unwrap();
        let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
        let file = SafeTensors::deserialize(&bytes).unwrap();
        let layer = if fixture == "tiny-mixtral" { 1 } else { 2 };
        for (part, suffix) in parts
            .iter()
            .zip(["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"])
        {
            let name = format!("blk.{layer}.{suffix}.weight");
            let stacked = hf.weights.tensor(&name).unwrap();
            let mut expected = Vec::new();
            for e in 0..moe.num_experts {
                let hf_name = expert
                    .replace("{e}", &e.to_string())
                    .replace("{part}", part);
                expected.extend_from_slice(file.tensor(&hf_name).unwrap().data());
            }
            assert_eq!(
                stacked.data.as_ref(),
                expected.as_slice(),
                "{fixture} {name}"
            );
            assert_eq!(stacked.shape[0], moe.num_experts);
            assert_eq!(Some(stacked.shape.clone()), hf.weights.shape(&name));
            let pattern = expert.replace("{e}", "*").replace("{part}", part);
            assert_eq!(hf.weights.hf_name(&name), Some(pattern.as_str()));
        }
        assert!(hf.weights.unmapped_names().is_empty(), "{fixture}");
    }
    // Qwen3-MoE's dense layer 1 keeps its plain MLP tensors.
    let hf = HfModelDir::open(tiny("tiny-qwen3-moe")).unwrap();
    assert!(hf.weights.tensor("blk.1.ffn_gate.weight").is_some());
    assert!(hf.weights.tensor("blk.1.ffn_gate_exps.weight").is_none());
}

/// Rewrites tiny-qwen3-moe's tensors through `edit` (name -> (dtype, shape, bytes)) into
/// `dir/model.safetensors`.
fn rewrite(dir: &Path, edit: impl FnOnce(&mut BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>)) {
    let bytes = std::fs::read(tiny("tiny-qwen3-moe/model.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)> = file
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            (
                name,
                (view.dtype(), view.shape().to_vec(), view.data().to_vec()),
            )
        })
        .collect();
    edit(&mut tensors);
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, (dtype, shape, data))| {
            (
                name.clone(),
                TensorView::new(*dtype, shape.clone(), data).unwrap(),
            )
        })
        .collect();
    let out = safetensors::serialize(views, None).unwrap();
    std::fs::write(dir.join("model.safetensors"), out).unwrap();
}

#[test]
fn a_missing_or_odd_expert_is_named() {
    let dir = scratch("missing-expert");
    rewrite(&dir, |tensors| {
        tensors.remove("model.layers.0.mlp.experts.3.up_proj.weight");
    });
    let error = SafetensorsWeights::open_dir(&dir).unwrap_err().to_string();
    assert!(
        error.contains("expert 3") && error.contains("blk.0.ffn_up_exps.weight"),
        "{error}"
    );

    rewrite(&dir, |tensors| {
        let (_, shape, data) = tensors
            .get_mut("model.layers.2.mlp.experts.5.down_proj.weight")
            .unwrap();
        // [32, 24] -> [24, 32]: the same bytes, another shape.
        *shape = vec![shape[1], shape[0]];
        let _ = data;
    });
    let error = SafetensorsWeights::open_dir(&dir).unwrap_err().to_string();
    assert!(
        error.contains("model.layers.2.mlp.experts.5.down_proj.weight"),
        "{error}"
    );

    // Stacked shapes are checked against the config like any tensor.
    std::fs::copy(
        tiny("tiny-qwen3-moe/model.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tiny("tiny-qwen3-moe/config.json")).unwrap())
            .unwrap();
    config["moe_intermediate_size"] = 25.into();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let error = HfModelDir::open(&dir).unwrap_err().to_string();
    assert!(
        error.contains("model.layers.0.mlp.experts.*.gate_proj.weight") && error.contains("25"),
        "{error}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
