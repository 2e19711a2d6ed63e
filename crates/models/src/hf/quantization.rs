//! The `quantization_config` of a `config.json`: which quantized safetensors pagoda reads.
//!
//! Three FP8 (e4m3) layouts, all dequantized at load (a weight is its e4m3 value times its
//! factor): DeepSeek's block-scaled `fp8` (`weight_block_size`, `<name>_scale_inv`), the
//! per-tensor `fp8` of vLLM / transformers (no `weight_block_size`, `<name>_scale`), and
//! compressed-tensors' `float-quantized` with a per-channel (`[out, 1]`) or per-tensor
//! `weight_scale`. Activations are never quantized: an `input_scale` is not used.

use serde_json::{Map, Value};

use super::{Fields, HfError};

/// The suggestion every refusal ends with.
const USE_GGUF: &str = "for other quantized weights use a GGUF file";

/// `quantization_config`, where there is one, must be one of the FP8 layouts above: other
/// methods store weights the safetensors reader cannot serve.
pub(super) fn check_quantization(fields: &Fields<'_>) -> Result<(), HfError> {
    let Some(map) = fields.object("quantization_config")? else {
        return Ok(());
    };
    let quantization = Fields {
        map,
        path: fields.path,
        prefix: "quantization_config.",
    };
    match quantization.str("quant_method")?.unwrap_or("(none)") {
        "fp8" => check_fp8(&quantization),
        "compressed-tensors" => check_compressed_tensors(&quantization),
        method => Err(quantization.error(
            "quant_method",
            &format!(
                "is `{method}`; pagoda reads F32, F16 and BF16 safetensors and FP8 (e4m3) weights \
                 (`fp8`, or `compressed-tensors` float-quantized); {USE_GGUF}"
            ),
        )),
    }
}

/// `quant_method: fp8`: e4m3 weights, block-scaled (DeepSeek) or per-tensor (vLLM).
fn check_fp8(quantization: &Fields<'_>) -> Result<(), HfError> {
    if let Some(other) = quantization.str("fmt")?.filter(|fmt| *fmt != "e4m3") {
        return Err(quantization.error(
            "fmt",
            &format!("is `{other}`; only `e4m3` FP8 weights are supported; {USE_GGUF}"),
        ));
    }
    match quantization.str("activation_scheme")? {
        None | Some("dynamic") | Some("static") => Ok(()),
        Some(other) => Err(quantization.error(
            "activation_scheme",
            &format!("is `{other}`; `dynamic` or `static` expected; {USE_GGUF}"),
        )),
    }
}

/// `quant_method: compressed-tensors`: only `float-quantized` 8-bit float weights with a
/// `channel` or `tensor` strategy; activations, if quantized, 8-bit float (not applied).
fn check_compressed_tensors(quantization: &Fields<'_>) -> Result<(), HfError> {
    match quantization.str("format")? {
        Some("float-quantized") | Some("naive-quantized") => {}
        other => {
            return Err(quantization.error(
                "format",
                &format!(
                    "is `{}`; only `float-quantized` (FP8 e4m3) compressed-tensors are \
                     supported; {USE_GGUF}",
                    other.unwrap_or("(none)")
                ),
            ))
        }
    }
    if quantization.get("kv_cache_scheme").is_some() {
        return Err(quantization.error(
            "kv_cache_scheme",
            &format!("is set; a quantized KV cache is not read from a checkpoint; {USE_GGUF}"),
        ));
    }
    let groups = quantization
        .object("config_groups")?
        .ok_or_else(|| quantization.error("config_groups", "is missing"))?;
    let path = quantization.path;
    for (name, group) in groups {
        let prefix = format!("quantization_config.config_groups.{name}.");
        let group = group.as_object().ok_or_else(|| {
            HfError::new(
                path,
                format!("field `{}` must be an object", &prefix[..prefix.len() - 1]),
            )
        })?;
        let group = Fields {
            map: group,
            path,
            prefix: &prefix,
        };
        let weights = group
            .object("weights")?
            .ok_or_else(|| group.error("weights", "is missing"))?;
        check_args(&group, "weights", weights, &["channel", "tensor"])?;
        if let Some(inputs) = group.object("input_activations")? {
            check_args(&group, "input_activations", inputs, &["token", "tensor"])?;
        }
        if group.get("output_activations").is_some() {
            return Err(group.error(
                "output_activations",
                &format!("is set; quantized outputs are not supported; {USE_GGUF}"),
            ));
        }
    }
    Ok(())
}

/// One compressed-tensors `QuantizationArgs`: 8-bit `float`, one of `strategies`.
fn check_args(
    group: &Fields<'_>,
    key: &str,
    args: &Map<String, Value>,
    strategies: &[&str],
) -> Result<(), HfError> {
    let prefix = format!("{}{key}.", group.prefix);
    let args = Fields {
        map: args,
        path: group.path,
        prefix: &prefix,
    };
    let kind = args.str("type")?.unwrap_or("(none)");
    let bits = args.usize("num_bits")?;
    if kind != "float" || bits != Some(8) {
        return Err(args.error(
            "type",
            &format!(
                "is `{kind}` with {} bits; only 8-bit `float` (FP8 e4m3) is supported; {USE_GGUF}",
                bits.map_or("no".into(), |bits| bits.to_string())
            ),
        ));
    }
    match args.str("strategy")? {
        Some(strategy) if strategies.contains(&strategy) => Ok(()),
        other => Err(args.error(
            "strategy",
            &format!(
                "is `{}`; {} expected; {USE_GGUF}",
                other.unwrap_or("(none)"),
                strategies
                    .iter()
                    .map(|s| format!("`{s}`"))
                    .collect::<Vec<_>>()
                    .join(" or ")
            ),
        )),
    }
}
