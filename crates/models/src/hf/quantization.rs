//! The `quantization_config` of a `config.json`: which quantized safetensors pagoda reads.

use super::{Fields, HfError};

/// `quantization_config`, where there is one, must be DeepSeek's block-scaled FP8 (e4m3
/// weights and `_scale_inv` factors, dequantized at load): other methods store weights the
/// safetensors reader cannot serve.
pub(super) fn check_quantization(fields: &Fields<'_>) -> Result<(), HfError> {
    let Some(map) = fields.object("quantization_config")? else {
        return Ok(());
    };
    let quantization = Fields {
        map,
        path: fields.path,
        prefix: "quantization_config.",
    };
    let method = quantization.str("quant_method")?.unwrap_or("(none)");
    if method != "fp8" {
        return Err(quantization.error(
            "quant_method",
            &format!(
                "is `{method}`; pagoda reads F32, F16 and BF16 safetensors and block-scaled FP8 \
                 (`fp8`, e4m3); for other quantized weights use a GGUF file"
            ),
        ));
    }
    match quantization.str("fmt")? {
        None | Some("e4m3") => Ok(()),
        Some(other) => Err(quantization.error(
            "fmt",
            &format!("is `{other}`; only `e4m3` FP8 weights are supported"),
        )),
    }
}
