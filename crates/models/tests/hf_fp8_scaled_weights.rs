//! FP8 (e4m3) safetensors with per-channel and per-tensor factors, as compressed-tensors
//! (`float-quantized`, `weight_scale` `[out, 1]` or `[]`) and vLLM's per-tensor `fp8`
//! (`weight_scale` `[1]`, a static `input_scale`) ship them. The test quantizes tiny-llama's
//! projections itself (lm_head stays BF16, as `ignore` lists it), writes the FP8 checkpoint
//! and the same weights dequantized to F32 with no quantization config, and the two must
//! give the same logits. Then the configs pagoda refuses, each naming its field.

use std::path::{Path, PathBuf};

use pagoda_kv::{BlockPool, BlockTable, PageTable};
use pagoda_models::formats::fp8::e4m3_to_f32;
use pagoda_models::hf::HfModelDir;
use pagoda_models::llama::{AttentionPolicy, ForwardBatch, KvCache, Model, WeightPrecision};
use pagoda_models::weights::TensorSource;
use pagoda_ops::attention::AttentionPath;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde_json::{json, Value};

fn tiny_llama() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tiny/tiny-llama")
}

/// A scratch directory unique to this test process and `name`, emptied first.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pagoda-fp8s-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[derive(Clone, Copy, Debug)]
enum Layout {
    /// compressed-tensors, `strategy: channel`: F32 `[out, 1]` factors, dynamic activations.
    Channel,
    /// compressed-tensors, `strategy: tensor`: one BF16 factor of shape `[]`.
    Tensor,
    /// vLLM / transformers `fp8` without blocks: F32 `[1]` factor, static `input_scale`.
    Vllm,
}

fn quantization_config(layout: Layout) -> Value {
    let group = |strategy: &str| {
        json!({"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                        "symmetric": true, "dynamic": false},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                  "symmetric": true, "dynamic": true},
            "output_activations": null
        }})
    };
    let compressed = |strategy: &str| {
        json!({"quant_method": "compressed-tensors", "format": "float-quantized",
               "quantization_status": "compressed", "config_groups": group(strategy),
               "ignore": ["lm_head"], "kv_cache_scheme": null})
    };
    match layout {
        Layout::Channel => compressed("channel"),
        Layout::Tensor => compressed("tensor"),
        Layout::Vllm => json!({"quant_method": "fp8", "activation_scheme": "static"}),
    }
}

/// The nearest finite e4m3 code to `x` (|x| <= 448).
fn to_e4m3(x: f32) -> u8 {
    let code = (0u8..0x7f)
        .min_by(|&a, &b| {
            let da = (e4m3_to_f32(a) - x.abs()).abs();
            da.total_cmp(&(e4m3_to_f32(b) - x.abs()).abs())
        })
        .unwrap();
    if x < 0.0 {
        code | 0x80
    } else {
        code
    }
}

fn bf16_round(x: f32) -> f32 {
    f32::from_bits(x.to_bits().wrapping_add(0x7fff + ((x.to_bits() >> 16) & 1)) & 0xffff_0000)
}

type Tensors = Vec<(String, Dtype, Vec<usize>, Vec<u8>)>;

fn write(dir: &Path, tensors: &Tensors, quantization: Option<Value>) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, dtype, shape, data)| {
            let view = TensorView::new(*dtype, shape.clone(), data).unwrap();
            (name.clone(), view)
        })
        .collect();
    let out = safetensors::serialize(views, None).unwrap();
    std::fs::write(dir.join("model.safetensors"), out).unwrap();
    for name in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(tiny_llama().join(name), dir.join(name)).unwrap();
    }
    let text = std::fs::read_to_string(tiny_llama().join("config.json")).unwrap();
    let mut config: Value = serde_json::from_str(&text).unwrap();
    if let Some(quantization) = quantization {
        config["quantization_config"] = quantization;
    }
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
}

/// Writes `<tag>-<layout>-fp8` (the FP8 checkpoint) and `<tag>-<layout>-f32` (its dequantized
/// twin): each test its own folders, so tests running side by side never share one.
fn checkpoints(layout: Layout, tag: &str) -> (PathBuf, PathBuf) {
    let bytes = std::fs::read(tiny_llama().join("model.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let (mut fp8, mut f32s): (Tensors, Tensors) = (Vec::new(), Vec::new());
    for (name, view) in file.tensors() {
        let entry = (
            name.clone(),
            view.dtype(),
            view.shape().to_vec(),
            view.data().to_vec(),
        );
        let projection = name.contains("_proj.weight");
        if !projection {
            fp8.push(entry.clone());
            f32s.push(entry);
            continue;
        }
        assert_eq!(view.dtype(), Dtype::BF16, "{name}");
        let values: Vec<f32> = view
            .data()
            .chunks_exact(2)
            .map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16))
            .collect();
        let (rows, cols) = (view.shape()[0], view.shape()[1]);
        let absmax = |row: &[f32]| row.iter().fold(0f32, |m, v| m.max(v.abs()));
        // Factors rounded to BF16 so the BF16 per-tensor scale is exact too.
        let factors: Vec<f32> = match layout {
            Layout::Channel => values
                .chunks(cols)
                .map(|r| bf16_round(absmax(r) / 448.0))
                .collect(),
            _ => vec![bf16_round(absmax(&values) / 448.0); rows],
        };
        let codes: Vec<u8> = values
            .iter()
            .enumerate()
            .map(|(i, v)| to_e4m3((v / factors[i / cols]).clamp(-448.0, 448.0)))
            .collect();
        let dequantized: Vec<u8> = codes
            .iter()
            .enumerate()
            .flat_map(|(i, &c)| (e4m3_to_f32(c) * factors[i / cols]).to_le_bytes())
            .collect();
        f32s.push((name.clone(), Dtype::F32, vec![rows, cols], dequantized));
        fp8.push((name.clone(), Dtype::F8_E4M3, vec![rows, cols], codes));
        let scale = format!("{name}_scale");
        let input = name.replace(".weight", ".input_scale");
        let f32_bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        match layout {
            Layout::Channel => fp8.push((scale, Dtype::F32, vec![rows, 1], f32_bytes(&factors))),
            Layout::Tensor => {
                let bf16 = ((factors[0].to_bits() >> 16) as u16).to_le_bytes().to_vec();
                fp8.push((scale, Dtype::BF16, vec![], bf16));
            }
            Layout::Vllm => {
                fp8.push((scale, Dtype::F32, vec![1], f32_bytes(&factors[..1])));
                fp8.push((input, Dtype::F32, vec![], f32_bytes(&[0.02])));
            }
        }
    }
    let (fp8_dir, f32_dir) = (
        scratch(&format!("{tag}-{layout:?}-fp8")),
        scratch(&format!("{tag}-{layout:?}-f32")),
    );
    write(&fp8_dir, &fp8, Some(quantization_config(layout)));
    write(&f32_dir, &f32s, None);
    (fp8_dir, f32_dir)
}

/// One prefill over `tokens`: the logits at every position.
fn logits(dir: &Path, tokens: &[u32]) -> Vec<f32> {
    let hf = HfModelDir::open(dir).unwrap();
    let model = Model::load(hf.config.clone(), &hf.weights, WeightPrecision::AsStored).unwrap();
    let page_size = 16;
    let num_pages = tokens.len().div_ceil(page_size);
    let mut pool = BlockPool::new(num_pages, page_size).unwrap();
    let mut table = BlockTable::new();
    let slots = table.append_slots(&mut pool, tokens.len()).unwrap();
    let page_table = PageTable::from_block_tables(&[&table], &pool).unwrap();
    let layout = model.kv_layout(num_pages, page_size);
    let mut kv = KvCache::new(model.config().num_layers, layout);
    let positions: Vec<u32> = (0..tokens.len() as u32).collect();
    let logits_for: Vec<usize> = (0..tokens.len()).collect();
    let batch = ForwardBatch {
        tokens,
        positions: &positions,
        slots: &slots,
        qo_indptr: &[0, tokens.len() as u32],
        page_table: &page_table,
        logits_for: &logits_for,
        sparse: &[],
    };
    let policy = AttentionPolicy::Force(AttentionPath::Gather);
    model.forward(&batch, &mut kv, policy).unwrap().logits
}

#[test]
fn per_channel_and_per_tensor_fp8_give_the_logits_of_their_dequantized_weights() {
    let tokens: Vec<u32> = (0..23).map(|i| (i * 37 + 5) % 256).collect();
    let original = logits(&tiny_llama(), &tokens);
    for layout in [Layout::Channel, Layout::Tensor, Layout::Vllm] {
        let (fp8_dir, f32_dir) = checkpoints(layout, "logits");
        let hf = HfModelDir::open(&fp8_dir).unwrap();
        // 7 projections in each of 2 layers; lm_head stays BF16.
        assert_eq!(hf.weights.fp8_tensors(), 14, "{layout:?}");
        assert_eq!(
            hf.weights.fp8_bytes(),
            2 * (64 * 64 * 2 + 32 * 64 * 2 + 3 * 128 * 64)
        );
        let unmapped = hf.weights.unmapped_names();
        let inputs = unmapped
            .iter()
            .filter(|n| n.ends_with(".input_scale"))
            .count();
        assert_eq!(
            inputs,
            if matches!(layout, Layout::Vllm) {
                14
            } else {
                0
            },
            "{unmapped:?}"
        );
        // The codes and one factor per row, as the GPU keeps them: the served values.
        let name = "blk.0.ffn_up.weight";
        let rows = hf.weights.fp8_rows(name).unwrap();
        assert_eq!((rows.codes.len(), rows.row_scales.len()), (128 * 64, 128));
        let served = hf.weights.tensor(name).unwrap();
        for (i, (&code, value)) in rows
            .codes
            .iter()
            .zip(served.data.chunks_exact(4))
            .enumerate()
        {
            let value = f32::from_le_bytes(value.try_into().unwrap());
            assert_eq!(
                e4m3_to_f32(code) * rows.row_scales[i / 64],
                value,
                "{layout:?} {i}"
            );
        }
        assert!(hf.weights.fp8_rows("output.weight").is_none());
        let (got, want) = (logits(&fp8_dir, &tokens), logits(&f32_dir, &tokens));
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            worst <= 1e-5,
            "{layout:?}: fp8 vs dequantized f32 differ by {worst}"
        );
        // The quantization is real: the logits move away from the BF16 model's, a little
        // (e4m3 keeps 3 mantissa bits).
        let diff = |a: &f32, b: &f32| (a - b).abs();
        let moved = got
            .iter()
            .zip(&original)
            .map(|(a, b)| diff(a, b))
            .fold(0f32, f32::max);
        let range = original.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(
            moved > 0.0 && moved < 0.2 * range,
            "{layout:?}: moved {moved} of {range}"
        );
        eprintln!("{layout:?}: worst {worst:.1e} against f32, {moved:.1e} against bf16");
        std::fs::remove_dir_all(&fp8_dir).unwrap();
        std::fs::remove_dir_all(&f32_dir).unwrap();
    }
}

/// The error of opening an FP8 checkpoint whose config or tensors `edit` changed.
fn refusal(name: &str, layout: Layout, edit: impl FnOnce(&mut Value, &mut Tensors)) -> String {
    let (fp8_dir, f32_dir) = checkpoints(layout, name);
    let bytes = std::fs::read(fp8_dir.join("model.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Tensors = file
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    let mut quantization = quantization_config(layout);
    edit(&mut quantization, &mut tensors);
    let dir = scratch(name);
    write(&dir, &tensors, Some(quantization));
    let error = HfModelDir::open(&dir).unwrap_err().to_string();
    for dir in [fp8_dir, f32_dir, dir] {
        std::fs::remove_dir_all(dir).unwrap();
    }
    error
}

/// A change to a checkpoint: its quantization config and tensors.
type Edit = Box<dyn FnOnce(&mut Value, &mut Tensors)>;

#[test]
fn other_quantization_schemes_are_refused_naming_the_field() {
    let weights = "/config_groups/group_0/weights";
    let cases: Vec<(&str, Layout, Edit, &str)> = vec![
        (
            "int8",
            Layout::Channel,
            Box::new(|q, _| q.pointer_mut(weights).unwrap()["type"] = json!("int")),
            "group_0.weights.type",
        ),
        (
            "int4",
            Layout::Channel,
            Box::new(|q, _| q.pointer_mut(weights).unwrap()["num_bits"] = json!(4)),
            "group_0.weights.type",
        ),
        (
            "group",
            Layout::Channel,
            Box::new(|q, _| q.pointer_mut(weights).unwrap()["strategy"] = json!("group")),
            "group_0.weights.strategy",
        ),
        (
            "packed",
            Layout::Channel,
            Box::new(|q, _| q["format"] = json!("pack-quantized")),
            "quantization_config.format",
        ),
        (
            "kv",
            Layout::Channel,
            Box::new(|q, _| q["kv_cache_scheme"] = json!({"num_bits": 8})),
            "kv_cache_scheme",
        ),
        (
            "outputs",
            Layout::Tensor,
            Box::new(|q, _| {
                q["config_groups"]["group_0"]["output_activations"] = json!({"num_bits": 8})
            }),
            "output_activations",
        ),
        (
            "scheme",
            Layout::Vllm,
            Box::new(|q, _| q["activation_scheme"] = json!("per-head")),
            "activation_scheme",
        ),
        (
            "awq",
            Layout::Vllm,
            Box::new(|q, _| q["quant_method"] = json!("awq")),
            "quant_method",
        ),
        (
            "no-scale",
            Layout::Channel,
            Box::new(|_, t| t.retain(|t| t.0 != "model.layers.1.mlp.up_proj.weight_scale")),
            "model.layers.1.mlp.up_proj.weight_scale",
        ),
        (
            "bad-scale",
            Layout::Channel,
            Box::new(|_, t| {
                let scale = t
                    .iter_mut()
                    .find(|t| t.0 == "model.layers.0.mlp.up_proj.weight_scale")
                    .unwrap();
                scale.2 = vec![3];
                scale.3.truncate(12);
            }),
            "block size",
        ),
    ];
    for (name, layout, edit, field) in cases {
        let error = refusal(name, layout, edit);
        assert!(error.contains(field), "{name}: {error}");
        assert!(!error.contains('\n'), "{name}: {error}");
        if !field.contains("weight_scale") && field != "block size" {
            assert!(error.contains("GGUF"), "{name}: {error}");
        }
    }
}
