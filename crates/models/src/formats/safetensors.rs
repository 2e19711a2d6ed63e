//! Hugging Face safetensors checkpoints: one `model.safetensors`, or the shards listed by
//! `model.safetensors.index.json`, memory-mapped and exposed under the canonical (GGUF)
//! tensor names of [`crate::weights`].
//!
//! HF stores a linear weight as `[out_features, in_features]`, row-major, which is already the
//! canonical convention, so shapes and bytes are passed through untouched. HF llama-family q/k
//! rows are in rotate-half order, so a model loaded from here uses `RopeStyle::Halves`.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use pagoda_tensor::GgmlType;
use safetensors::{Dtype, SafeTensors};

use super::fp8;
use crate::weights::{RawTensor, TensorSource};

mod fp8_scales;
mod hf_names;
use hf_names::expert_pattern;
pub use hf_names::{canonical_expert_name, canonical_name};

/// File name of a single-file checkpoint inside a model directory.
pub const SINGLE_FILE_NAME: &str = "model.safetensors";
/// File name of the shard index (`{"weight_map": {tensor name: shard file}}`).
pub const INDEX_FILE_NAME: &str = "model.safetensors.index.json";

/// Why a safetensors checkpoint could not be loaded. The message always names the file.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {kind}")]
pub struct SafetensorsError {
    /// The file (or directory) the problem is in.
    pub path: PathBuf,
    /// What is wrong, naming the tensor or field where there is one.
    pub kind: String,
}

impl SafetensorsError {
    fn new(path: &Path, kind: impl Into<String>) -> SafetensorsError {
        SafetensorsError {
            path: path.to_path_buf(),
            kind: kind.into(),
        }
    }
}

/// One memory-mapped `.safetensors` file.
struct Shard {
    path: PathBuf,
    mmap: Mmap,
}

/// Where one canonical tensor lives.
#[derive(Debug, Clone)]
struct TensorEntry {
    hf_name: String,
    shard: usize,
    ty: GgmlType,
    shape: Vec<usize>,
    /// Byte range inside the shard's memory map (header already skipped).
    start: usize,
    end: usize,
    /// Stored as `F8_E4M3` (served dequantized to F32 with its block factors).
    fp8: bool,
    /// An FP8 weight's block factors (`<name>_scale_inv`), paired after every shard is read.
    fp8_scales: Option<Box<TensorEntry>>,
}

/// A canonical tensor stacked from one HF tensor per expert (`[num_experts, out, in]`, as
/// GGUF stores `ffn_{gate,up,down}_exps`); served as an owned copy of the parts in order.
#[derive(Debug, Clone)]
struct StackedEntry {
    /// The HF names with the expert index as `*`, for messages.
    hf_pattern: String,
    /// Expert `e`'s part at index `e`; all of one dtype and shape.
    parts: Vec<TensorEntry>,
}

impl StackedEntry {
    fn shape(&self) -> Vec<usize> {
        let mut shape = vec![self.parts.len()];
        shape.extend(&self.parts[0].shape);
        shape
    }
}

/// A loaded safetensors checkpoint (one file or all shards), memory-mapped.
///
/// Only tensors whose HF name has a canonical equivalent ([`canonical_name`]) are served;
/// the others (e.g. `rotary_emb.inv_freq` buffers of old checkpoints) are listed by
/// [`SafetensorsWeights::unmapped_names`]. Every served tensor is F32, F16 or BF16 (checked
/// at open). The bytes handed out are little-endian and borrowed from the map; they are
/// aligned only as far as the file aligns them (the reference writer pads the header to 8
/// bytes), so readers must not assume element alignment.
pub struct SafetensorsWeights {
    shards: Vec<Shard>,
    tensors: BTreeMap<String, TensorEntry>,
    /// Mixture-of-experts tensors, stacked from their per-expert parts ([`canonical_expert_name`]).
    stacked: BTreeMap<String, StackedEntry>,
    /// Per-expert parts by canonical stacked name and expert index, until [`Self::stack_experts`].
    expert_parts: BTreeMap<String, BTreeMap<usize, TensorEntry>>,
    unmapped: Vec<String>,
    /// `<weight>_scale_inv` tensors by their weight's HF name, until [`Self::pair_fp8_scales`].
    fp8_scales: BTreeMap<String, TensorEntry>,
}

impl std::fmt::Debug for SafetensorsWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafetensorsWeights")
            .field("shards", &self.shard_paths())
            .field("num_tensors", &self.tensors.len())
            .field("unmapped", &self.unmapped)
            .finish()
    }
}

impl SafetensorsWeights {
    /// Loads the checkpoint of a HF model directory: `model.safetensors` if present
    /// (as transformers does), else `model.safetensors.index.json` and its shards.
    pub fn open_dir(dir: impl AsRef<Path>) -> Result<SafetensorsWeights, SafetensorsError> {
        let dir = dir.as_ref();
        let single = dir.join(SINGLE_FILE_NAME);
        let index = dir.join(INDEX_FILE_NAME);
        let weights = if single.is_file() {
            SafetensorsWeights::open_file(&single)
        } else if index.is_file() {
            SafetensorsWeights::open_index(&index)
        } else {
            Err(SafetensorsError::new(
                dir,
                format!(
                    "no weights found: neither {SINGLE_FILE_NAME} nor {INDEX_FILE_NAME} exists"
                ),
            ))
        }?;
        let (fp8, shown) = (weights.fp8_tensors(), dir.display());
        if fp8 > 0 {
            tracing::info!(
                "{shown}: {fp8} FP8 (e4m3) weights, {} bytes in the file, dequantized at load",
                weights.fp8_bytes()
            );
        }
        Ok(weights)
    }

    /// Loads a single `.safetensors` file.
    pub fn open_file(path: impl AsRef<Path>) -> Result<SafetensorsWeights, SafetensorsError> {
        let mut weights = SafetensorsWeights::empty();
        weights.add_shard(path.as_ref(), None)?;
        weights.pair_fp8_scales(path.as_ref())?;
        weights.stack_experts(path.as_ref())?;
        Ok(weights)
    }

    /// Loads a sharded checkpoint from its index file. Shard paths in `weight_map` are
    /// relative to the index's directory; each must exist and must hold the tensors the
    /// index assigns to it.
    pub fn open_index(
        index_path: impl AsRef<Path>,
    ) -> Result<SafetensorsWeights, SafetensorsError> {
        let index_path = index_path.as_ref();
        let text = std::fs::read_to_string(index_path)
            .map_err(|error| SafetensorsError::new(index_path, format!("cannot read: {error}")))?;
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|error| {
            SafetensorsError::new(index_path, format!("malformed JSON: {error}"))
        })?;
        let weight_map = json
            .get("weight_map")
            .and_then(|value| value.as_object())
            .ok_or_else(|| {
                SafetensorsError::new(index_path, "field `weight_map` is missing or not an object")
            })?;
        let mut by_shard: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (tensor_name, shard) in weight_map {
            let shard = shard.as_str().ok_or_else(|| {
                SafetensorsError::new(
                    index_path,
                    format!("`weight_map.{tensor_name}` must be a file name string"),
                )
            })?;
            if shard.contains("..") || Path::new(shard).is_absolute() {
                return Err(SafetensorsError::new(
                    index_path,
                    format!("shard file name `{shard}` must be relative to the index's directory"),
                ));
            }
            by_shard
                .entry(shard.to_string())
                .or_default()
                .insert(tensor_name.clone());
        }
        if by_shard.is_empty() {
            return Err(SafetensorsError::new(
                index_path,
                "`weight_map` lists no tensors",
            ));
        }
        let dir = index_path.parent().unwrap_or(Path::new("."));
        let mut weights = SafetensorsWeights::empty();
        for (shard, listed) in &by_shard {
            let shard_path = dir.join(shard);
            if !shard_path.is_file() {
                return Err(SafetensorsError::new(
                    index_path,
                    format!(
                        "shard file {} listed in `weight_map` does not exist",
                        shard_path.display()
                    ),
                ));
            }
            weights.add_shard(&shard_path, Some(listed))?;
        }
        weights.pair_fp8_scales(index_path)?;
        weights.stack_experts(index_path)?;
        Ok(weights)
    }

    fn empty() -> SafetensorsWeights {
        SafetensorsWeights {
            shards: Vec::new(),
            tensors: BTreeMap::new(),
            stacked: BTreeMap::new(),
            expert_parts: BTreeMap::new(),
            unmapped: Vec::new(),
            fp8_scales: BTreeMap::new(),
        }
    }

    /// Turns the per-expert parts gathered from every shard into stacked tensors: each needs
    /// every expert from 0 up, all of one dtype and 2-D shape. Errors name `path`.
    fn stack_experts(&mut self, path: &Path) -> Result<(), SafetensorsError> {
        for (canonical, parts) in std::mem::take(&mut self.expert_parts) {
            let parts: Vec<TensorEntry> = parts
                .into_iter()
                .enumerate()
                .map(|(expected, (expert, part))| {
                    if expert == expected {
                        Ok(part)
                    } else {
                        Err(SafetensorsError::new(
                            path,
                            format!("expert {expected} of `{canonical}` is missing (found expert {expert})"),
                        ))
                    }
                })
                .collect::<Result<_, _>>()?;
            let first = &parts[0];
            if let Some(odd) = parts.iter().find(|part| {
                part.ty != first.ty || part.shape != first.shape || part.shape.len() != 2
            }) {
                return Err(SafetensorsError::new(
                    path,
                    format!(
                        "tensor `{}` has dtype {} and shape {:?}, but `{}` has {} and {:?} (experts must be 2-D and alike)",
                        odd.hf_name, odd.ty, odd.shape, first.hf_name, first.ty, first.shape
                    ),
                ));
            }
            let hf_pattern = expert_pattern(&first.hf_name);
            self.stacked
                .insert(canonical, StackedEntry { hf_pattern, parts });
        }
        Ok(())
    }

    /// The row-major shape of a canonical tensor, without reading (or stacking) its bytes.
    pub fn shape(&self, canonical: &str) -> Option<Vec<usize>> {
        match self.tensors.get(canonical) {
            Some(entry) => Some(entry.shape.clone()),
            None => self.stacked.get(canonical).map(StackedEntry::shape),
        }
    }

    /// Maps one file and registers its tensors. With `listed`, every listed name must be
    /// in the file (tensors the index does not list are still loaded).
    fn add_shard(
        &mut self,
        path: &Path,
        listed: Option<&BTreeSet<String>>,
    ) -> Result<(), SafetensorsError> {
        let file = File::open(path)
            .map_err(|error| SafetensorsError::new(path, format!("cannot open: {error}")))?;
        // SAFETY: the map is read-only and lives as long as `self`; like every mmap-based
        // loader we assume the checkpoint is not truncated or rewritten while it is open.
        let mmap = unsafe { Mmap::map(&file) }
            .map_err(|error| SafetensorsError::new(path, format!("cannot memory-map: {error}")))?;
        let (header_len, metadata) = SafeTensors::read_metadata(&mmap).map_err(|error| {
            SafetensorsError::new(path, format!("invalid safetensors file: {error}"))
        })?;
        let data_start = 8 + header_len;
        let shard_index = self.shards.len();
        let infos = metadata.tensors();
        if let Some(listed) = listed {
            if let Some(missing) = listed.iter().find(|name| !infos.contains_key(*name)) {
                return Err(SafetensorsError::new(
                    path,
                    format!("tensor `{missing}` is assigned to this shard by the index but is not in it"),
                ));
            }
        }
        let mut hf_names: Vec<&String> = infos.keys().collect();
        hf_names.sort();
        for hf_name in hf_names {
            let info = infos[hf_name];
            let (start, end) = info.data_offsets;
            if let Some(weight) = fp8_scales::scaled_weight(hf_name) {
                let ty = ggml_type(info.dtype);
                let entry = TensorEntry {
                    hf_name: hf_name.clone(),
                    shard: shard_index,
                    ty: ty.ok_or_else(|| {
                        SafetensorsError::new(
                            path,
                            format!(
                                "FP8 scale tensor `{hf_name}` has dtype {}; F32, F16 or BF16 expected",
                                info.dtype
                            ),
                        )
                    })?,
                    shape: info.shape.clone(),
                    start: data_start + start,
                    end: data_start + end,
                    fp8: false,
                    fp8_scales: None,
                };
                if let Some(twin) = self.fp8_scales.insert(weight.to_string(), entry) {
                    return Err(SafetensorsError::new(
                        path,
                        format!(
                            "FP8 weight `{weight}` has two scales: `{}` and `{hf_name}`",
                            twin.hf_name
                        ),
                    ));
                }
                continue;
            }
            let (canonical, expert) = match canonical_name(hf_name) {
                Some(canonical) => (canonical, None),
                None => match canonical_expert_name(hf_name) {
                    Some((canonical, expert)) => (canonical, Some(expert)),
                    None => {
                        self.unmapped.push(hf_name.clone());
                        continue;
                    }
                },
            };
            // An FP8 weight is served dequantized to F32 once its scales are paired.
            let fp8 = info.dtype == Dtype::F8_E4M3;
            let ty = ggml_type(info.dtype)
                .or(fp8.then_some(GgmlType::F32))
                .ok_or_else(|| {
                    SafetensorsError::new(
                        path,
                        format!(
                            "tensor `{hf_name}` has dtype {}; supported dtypes are F32, F16, BF16 \
                             and scaled F8_E4M3",
                            info.dtype
                        ),
                    )
                })?;
            let entry = TensorEntry {
                hf_name: hf_name.clone(),
                shard: shard_index,
                ty,
                shape: info.shape.clone(),
                start: data_start + start,
                end: data_start + end,
                fp8,
                fp8_scales: None,
            };
            let previous = match expert {
                Some(expert) => self
                    .expert_parts
                    .entry(canonical.clone())
                    .or_default()
                    .insert(expert, entry),
                None => self.tensors.insert(canonical.clone(), entry),
            };
            if let Some(previous) = previous {
                return Err(SafetensorsError::new(
                    path,
                    format!(
                        "tensor `{hf_name}` (canonical `{canonical}`) is also stored in {}",
                        self.shards[previous.shard].path.display()
                    ),
                ));
            }
        }
        self.shards.push(Shard {
            path: path.to_path_buf(),
            mmap,
        });
        Ok(())
    }

    /// The HF name a canonical tensor was stored under (a stacked expert tensor: its parts'
    /// names with `*` for the expert index).
    pub fn hf_name(&self, canonical: &str) -> Option<&str> {
        match self.tensors.get(canonical) {
            Some(entry) => Some(&entry.hf_name),
            None => self
                .stacked
                .get(canonical)
                .map(|entry| entry.hf_pattern.as_str()),
        }
    }

    /// HF tensor names with no canonical equivalent; they are not served.
    pub fn unmapped_names(&self) -> &[String] {
        &self.unmapped
    }

    /// The memory-mapped files, in load order.
    pub fn shard_paths(&self) -> Vec<&Path> {
        self.shards
            .iter()
            .map(|shard| shard.path.as_path())
            .collect()
    }

    /// Number of stored `F8_E4M3` weights (expert parts counted one by one).
    pub fn fp8_tensors(&self) -> usize {
        let parts = self.stacked.values().flat_map(|stacked| &stacked.parts);
        self.tensors.values().chain(parts).filter(|e| e.fp8).count()
    }

    /// Number of served (canonical) tensors.
    pub fn len(&self) -> usize {
        self.tensors.len() + self.stacked.len()
    }

    /// Whether no tensor is served.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl TensorSource for SafetensorsWeights {
    fn tensor(&self, name: &str) -> Option<RawTensor<'_>> {
        // In bounds: the safetensors crate checked every offset against the buffer length.
        let stored = |entry: &TensorEntry| &self.shards[entry.shard].mmap[entry.start..entry.end];
        let bytes = |entry: &TensorEntry| match &entry.fp8_scales {
            None => Cow::Borrowed(stored(entry)),
            Some(scales) => {
                // F32, F16 or BF16 (checked when the scales were read).
                let stored_scales = stored(scales);
                let width = if scales.ty == GgmlType::F32 { 4 } else { 2 };
                let mut factors = vec![0f32; stored_scales.len() / width];
                pagoda_tensor::quant::dequantize(scales.ty, stored_scales, &mut factors)
                    .expect("FP8 scales are F32, F16 or BF16");
                let data = fp8::dequantize(stored(entry), &entry.shape, &factors, &scales.shape);
                // The shapes were checked when the scales were paired.
                Cow::Owned(data.expect("FP8 shapes checked at open"))
            }
        };
        if let Some(entry) = self.tensors.get(name) {
            return Some(RawTensor {
                ty: entry.ty,
                shape: entry.shape.clone(),
                data: bytes(entry),
            });
        }
        let stacked = self.stacked.get(name)?;
        let mut data = Vec::new();
        for part in &stacked.parts {
            data.extend_from_slice(&bytes(part));
        }
        Some(RawTensor {
            ty: stacked.parts[0].ty,
            shape: stacked.shape(),
            data: Cow::Owned(data),
        })
    }

    fn fp8_rows(&self, name: &str) -> Option<crate::weights::Fp8Rows<'_>> {
        self.stored_fp8_rows(name)
    }

    fn tensor_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .tensors
            .keys()
            .chain(self.stacked.keys())
            .cloned()
            .collect();
        names.sort();
        names
    }
}

/// The storage type of a safetensors dtype, for the dtypes pagoda reads (F32, F16, BF16).
pub fn ggml_type(dtype: Dtype) -> Option<GgmlType> {
    match dtype {
        Dtype::F32 => Some(GgmlType::F32),
        Dtype::F16 => Some(GgmlType::F16),
        Dtype::BF16 => Some(GgmlType::BF16),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_every_layer_suffix() {
        assert_eq!(
            canonical_name("model.layers.12.mlp.down_proj.weight").as_deref(),
            Some("blk.12.ffn_down.weight")
        );
        assert_eq!(
            canonical_name("model.layers.0.self_attn.k_norm.weight").as_deref(),
            Some("blk.0.attn_k_norm.weight")
        );
        assert_eq!(
            canonical_name("model.layers.1.self_attn.v_proj.bias").as_deref(),
            Some("blk.1.attn_v.bias")
        );
        assert_eq!(
            canonical_name("lm_head.weight").as_deref(),
            Some("output.weight")
        );
        assert_eq!(canonical_name("model.layers.01.mlp.up_proj.weight"), None);
        assert_eq!(
            canonical_name("model.layers.0.self_attn.rotary_emb.inv_freq"),
            None
        );
        assert_eq!(canonical_name("model.layers.x.mlp.up_proj.weight"), None);
        assert_eq!(
            canonical_name("model.layers.2.block_sparse_moe.gate.weight").as_deref(),
            Some("blk.2.ffn_gate_inp.weight")
        );
    }

    #[test]
    fn maps_expert_tensors_to_their_stacked_names() {
        let name = |hf: &str| canonical_expert_name(hf);
        assert_eq!(
            name("model.layers.3.mlp.experts.17.down_proj.weight"),
            Some(("blk.3.ffn_down_exps.weight".into(), 17))
        );
        assert_eq!(
            name("model.layers.0.block_sparse_moe.experts.7.w1.weight"),
            Some(("blk.0.ffn_gate_exps.weight".into(), 7))
        );
        assert_eq!(
            name("model.layers.0.block_sparse_moe.experts.7.w3.weight"),
            Some(("blk.0.ffn_up_exps.weight".into(), 7))
        );
        assert_eq!(name("model.layers.0.mlp.experts.07.up_proj.weight"), None);
        assert_eq!(name("model.layers.0.mlp.gate_proj.weight"), None);
        assert_eq!(
            expert_pattern("model.layers.0.mlp.experts.3.up_proj.weight"),
            "model.layers.0.mlp.experts.*.up_proj.weight"
        );
    }
}
