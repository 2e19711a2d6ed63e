//! The CUDA model's kernel choices, resolved once from the configuration by whoever builds
//! the model's step buffers ([`CudaKernels::from_config`]) and carried in
//! [`CudaCacheOptions`](super::CudaCacheOptions); nothing below reads a setting itself.

use pagoda_cuda::{CudaError, DType};
use pagoda_ops::cuda::{self as ops, FilteredSampling, MergeMode, PrefillKernel};

/// Which kernels a CUDA step runs where more than one does the job. The defaults are the
/// measured fastest on the H200; the others stay as fallbacks and oracles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaKernels {
    /// Prefill attention (`PAGODA_CUDA_PREFILL`): the streaming tensor-core kernel
    /// (`Stream`, falling back to `Mma` at head_dim 256 and to `Tiled` where neither
    /// applies), the WMMA kernel, query-tiled, or one CTA per token (the oracle).
    /// Measured on the H200 (`docs/benchmark_results/decode-tuning-h200-2026-12-04.md`).
    pub prefill: PrefillKernel,
    /// The streaming prefill's tiling (`PAGODA_CUDA_PREFILL_TILING`; `None`: the tuning
    /// table's choice for the step's bucket, else [`ops::PrefillStreamTiling::heuristic`]).
    /// The tiling inside `prefill` is replaced per step by this choice.
    pub prefill_tiling: Option<ops::PrefillStreamTiling>,
    /// RoPE and the KV append in one launch per layer (`PAGODA_CUDA_FUSED_ROPE_APPEND`; the
    /// same bits as the two kernels).
    pub fused_rope_append: bool,
    /// A mixed step's decode rows attend through the fused decode, its chunks through the
    /// prefill kernel (`PAGODA_CUDA_MIXED_STEPS=split`); off: every row through the prefill
    /// kernel.
    pub mixed_split: bool,
    /// Prefill and mixed steps of up to this many tokens replay their kernels between
    /// attentions from piecewise graphs per token bucket (`PAGODA_CUDA_PIECEWISE_TOKENS`;
    /// 0: off).
    pub piecewise_tokens: usize,
    /// Linear layers of at most `ops::GEMV_MAX_ROWS` rows (decode steps, small batches) on
    /// the small-batch kernel instead of cuBLAS (`PAGODA_CUDA_GEMV`; off: slower than cuBLAS
    /// on the H200 so far, `docs/benchmark_results/gemv-small-h200-2026-12-04.md`).
    pub gemv: bool,
    /// Rows up to which a step multiplies quantized matrices in place (`gemv_quant`), more
    /// decoding each matrix for cuBLAS (`PAGODA_CUDA_QUANT_GEMV_ROWS`).
    pub quant_gemv_rows: usize,
    /// Rows up to which a step of more than `quant_gemv_rows` multiplies quantized matrices
    /// on the tensor cores (`gemm_quant_mma`), more decoding each matrix for cuBLAS
    /// (`PAGODA_CUDA_QUANT_MMA_ROWS`; 0: off).
    pub quant_mma_rows: usize,
    /// The layout of the in-place quantized kernel (`PAGODA_CUDA_QUANT_GEMV_KERNEL`).
    pub quant_gemv_kernel: ops::QuantGemvKernel,
    /// In-place steps: the RMSNorm and SiLU x up before a quantized matrix write its q8
    /// activations in their own launch, the separate quantize launch skipped
    /// (`PAGODA_CUDA_QUANT_FUSED_Q8`; the same bytes).
    pub quant_fused_q8: bool,
    /// A stacked matrix of two quantized formats (a Q4_K_M QKV whose v is Q6_K) multiplies
    /// in one launch (`PAGODA_CUDA_QUANT_PAIR`; the same bits as two).
    pub quant_pair: bool,
    /// Steps of more rows than the in-place FP8 kernel takes multiply FP8 matrices on
    /// cuBLASLt's FP8 GEMM, each activation row quantized to e4m3 with its own factor
    /// (`PAGODA_CUDA_FP8_GEMM`; never in deterministic mode); off: each matrix decoded into a
    /// bf16 scratch for cuBLAS.
    pub fp8_gemm: bool,
    /// With the FP8 GEMM, steps of up to this many rows multiply FP8 matrices in place
    /// (`PAGODA_CUDA_FP8_GEMV_ROWS`).
    pub fp8_gemv_rows: usize,
    /// MoE steps of `ops::MOE_MMA_MIN_ROWS` or more bf16 rows run the experts on tensor
    /// cores (`PAGODA_CUDA_MOE_MMA`; never in deterministic mode); off: the CUDA-core tiles.
    pub moe_mma: bool,
    /// A MoE model's step buffers hold the q8 activations of its quantized experts
    /// (`PAGODA_CUDA_MOE_QUANT`; the loader reads the same setting to keep them in blocks).
    pub moe_quant: bool,
    /// Steps of at least this many rows decode quantized experts into the dense expert
    /// kernels' stacks (`PAGODA_CUDA_MOE_QUANT_DENSE_ROWS`; 0: never; never in
    /// deterministic mode, where a row's sums must not depend on its step's size).
    pub moe_quant_dense_rows: usize,
    /// The fused decode's partial kernel (`PAGODA_PAGED_DECODE_KERNEL`; `Auto`: the tuning
    /// table's choice for the step's bucket, else the built-in heuristic).
    pub decode: DecodeKernelChoice,
    /// Where the fused decode merges a request's chunks (`PAGODA_PAGED_DECODE_MERGE`; `None`:
    /// the tuning table's choice, else a second launch).
    pub merge: Option<MergeMode>,
    /// CTAs the fused decode's plan aims for (`PAGODA_PAGED_DECODE_TARGET_CTAS`; `None`:
    /// the tuning table's choice, else two waves, twice the SM count).
    pub target_ctas: Option<usize>,
    /// Pages per fused decode chunk (`PAGODA_PAGED_DECODE_CHUNK`; `None`: the plan searches).
    pub pages_per_chunk: Option<usize>,
    /// Cascade decode steps' rule (`PAGODA_CASCADE_ATTENTION`: `auto` is
    /// [`CUDA_AUTO_CASCADE_RULE`](super::CUDA_AUTO_CASCADE_RULE), `on` any two requests
    /// sharing a page, `off` `None`).
    pub cascade: Option<pagoda_ops::attention::CascadeRule>,
    /// Keep the key summaries and the device page selection of sparse decode
    /// (`--sparse-attention`, `PAGODA_SPARSE_ATTENTION` set to anything but `off`): which
    /// requests run sparse is the engine's choice per step.
    pub sparse_decode: bool,
    /// Sparse decode's page scores and selection (`PAGODA_CUDA_SPARSE_SELECT`; the same
    /// pages either way).
    pub sparse_select: ops::SparseSelectKernels,
    /// The device sampler's paths.
    pub sampling: SamplingKernels,
    /// Batch-invariant steps (`PAGODA_DETERMINISTIC`, `--deterministic`): GEMMs on one
    /// algorithm per weight shape (`Gpu::set_gemm_batch_invariant`) and every attention row,
    /// prefill or decode, on the one-CTA-per-token kernel, whose order over a row's keys
    /// depends on nothing but the row. `prefill` and the decode choices are then unused.
    pub deterministic: bool,
    /// The KV cache in e4m3 with one f32 scale per (token, KV head) (`-ctk fp8 -ctv fp8`,
    /// `--kv-cache-dtype fp8`): the fused decode runs the streaming tensor-core kernel (or
    /// CUDA cores, by the heuristic or `PAGODA_PAGED_DECODE_KERNEL`) and the prefill the
    /// tiled kernel, those that read it (`StepBuffers::new` refuses the rest).
    pub kv_fp8: bool,
}

/// The device sampler's paths (every choice gives the same tokens; the defaults measured
/// fastest in `pagoda bench sampling --device cuda` on the H200).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SamplingKernels {
    /// The filtered rows' path (`PAGODA_GPU_SAMPLING_FILTERED`): fast, or the f64 oracle.
    pub filtered: FilteredSampling,
    /// Launches without filtered rows find the row maxima in the Gumbel kernel
    /// (`PAGODA_GPU_SAMPLING_GUMBEL_MAX`).
    pub gumbel_max: bool,
    /// Top-k rows run their rounds on their id list (`PAGODA_GPU_SAMPLING_LIST_ROUNDS`;
    /// measured faster at batch 64).
    pub list_rounds: bool,
    /// Top-p launches without top-k rows run the whole fast path in one thread-block
    /// cluster per row (`PAGODA_GPU_SAMPLING_CLUSTER`; faster at batch 16 and 64, level at
    /// batch 1; compute capability 9.0+).
    pub cluster: bool,
    /// Cluster launches with more rows than fit at once prefetch the waiting rows' logits
    /// into L2 (`PAGODA_GPU_SAMPLING_PREFETCH`; faster at batch 48 and 64).
    pub cluster_prefetch: bool,
}

impl Default for SamplingKernels {
    fn default() -> Self {
        SamplingKernels {
            filtered: FilteredSampling::Fast,
            gumbel_max: true,
            list_rounds: true,
            cluster: true,
            cluster_prefetch: true,
        }
    }
}

/// The fused decode's partial kernel as configured.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DecodeKernelChoice {
    /// The tuning table's choice for the step's bucket; else the streaming tensor-core
    /// kernel for bf16 where it supports the head size (measured fastest on the H200), else
    /// CUDA cores.
    #[default]
    Auto,
    /// The streaming tensor-core kernel at its default tiling; an error where it does not
    /// apply.
    Streaming,
    /// The WMMA tensor-core kernel; an error where it does not apply.
    TensorCore,
    /// CUDA cores.
    CudaCore,
}

impl Default for CudaKernels {
    fn default() -> Self {
        CudaKernels {
            prefill: PrefillKernel::Stream(ops::PrefillStreamTiling::DEFAULT),
            prefill_tiling: None,
            fused_rope_append: true,
            mixed_split: true,
            piecewise_tokens: 256,
            gemv: false,
            quant_gemv_rows: 8,
            quant_mma_rows: 32,
            quant_gemv_kernel: ops::QuantGemvKernel::default(),
            quant_fused_q8: true,
            quant_pair: true,
            fp8_gemm: true,
            fp8_gemv_rows: 2,
            moe_mma: true,
            moe_quant: false,
            moe_quant_dense_rows: ops::MOE_QUANT_DENSE_MIN_ROWS,
            decode: DecodeKernelChoice::Auto,
            merge: None,
            target_ctas: None,
            pages_per_chunk: None,
            cascade: Some(super::CUDA_AUTO_CASCADE_RULE),
            sparse_decode: false,
            sparse_select: ops::SparseSelectKernels::Radix,
            sampling: SamplingKernels::default(),
            deterministic: false,
            kv_fp8: false,
        }
    }
}

impl CudaKernels {
    /// The choices of `config` (its values were checked when it was resolved).
    pub fn from_config(config: &pagoda_config::Config) -> Self {
        let count = |name| config.number(name).map(|n| n as usize);
        CudaKernels {
            prefill: match config.word("PAGODA_CUDA_PREFILL") {
                "mma" => PrefillKernel::Mma,
                "tiled" => PrefillKernel::Tiled,
                "reference" => PrefillKernel::PerToken,
                _ => PrefillKernel::Stream(ops::PrefillStreamTiling::DEFAULT),
            },
            prefill_tiling: ops::PrefillStreamTiling::parse(
                config.word("PAGODA_CUDA_PREFILL_TILING"),
            ),
            fused_rope_append: config.on("PAGODA_CUDA_FUSED_ROPE_APPEND"),
            mixed_split: config.word("PAGODA_CUDA_MIXED_STEPS") == "split",
            piecewise_tokens: count("PAGODA_CUDA_PIECEWISE_TOKENS").unwrap_or(256),
            gemv: config.on("PAGODA_CUDA_GEMV"),
            quant_gemv_rows: count("PAGODA_CUDA_QUANT_GEMV_ROWS").unwrap_or(8),
            quant_mma_rows: count("PAGODA_CUDA_QUANT_MMA_ROWS").unwrap_or(32),
            quant_gemv_kernel: match config.word("PAGODA_CUDA_QUANT_GEMV_KERNEL") {
                "units" => ops::QuantGemvKernel::UNITS,
                "units1" => ops::QuantGemvKernel::Units { warp_rows: Some(1) },
                "units2" => ops::QuantGemvKernel::Units { warp_rows: Some(2) },
                "units4" => ops::QuantGemvKernel::Units { warp_rows: Some(4) },
                _ => ops::QuantGemvKernel::Groups,
            },
            quant_fused_q8: config.on("PAGODA_CUDA_QUANT_FUSED_Q8"),
            quant_pair: config.on("PAGODA_CUDA_QUANT_PAIR"),
            fp8_gemm: config.on("PAGODA_CUDA_FP8_GEMM"),
            fp8_gemv_rows: count("PAGODA_CUDA_FP8_GEMV_ROWS").unwrap_or(2),
            moe_mma: config.on("PAGODA_CUDA_MOE_MMA"),
            moe_quant: config.on("PAGODA_CUDA_MOE_QUANT"),
            moe_quant_dense_rows: count("PAGODA_CUDA_MOE_QUANT_DENSE_ROWS")
                .unwrap_or(ops::MOE_QUANT_DENSE_MIN_ROWS),
            decode: match config.word("PAGODA_PAGED_DECODE_KERNEL") {
                "stream" => DecodeKernelChoice::Streaming,
                "mma" => DecodeKernelChoice::TensorCore,
                "cuda-core" => DecodeKernelChoice::CudaCore,
                _ => DecodeKernelChoice::Auto,
            },
            merge: match config.word("PAGODA_PAGED_DECODE_MERGE") {
                "kernel" => Some(MergeMode::InKernel),
                "separate" => Some(MergeMode::Separate),
                _ => None,
            },
            target_ctas: count("PAGODA_PAGED_DECODE_TARGET_CTAS"),
            pages_per_chunk: count("PAGODA_PAGED_DECODE_CHUNK"),
            cascade: match config.word("PAGODA_CASCADE_ATTENTION") {
                "on" => Some(pagoda_ops::attention::CascadeRule::ANY),
                "auto" => Some(super::CUDA_AUTO_CASCADE_RULE),
                _ => None,
            },
            sparse_decode: matches!(
                pagoda_ops::attention::SparseAttention::from_config(config),
                Ok(Some(_))
            ),
            sparse_select: ops::SparseSelectKernels::parse(
                config.word("PAGODA_CUDA_SPARSE_SELECT"),
            )
            .unwrap_or_default(),
            sampling: SamplingKernels {
                filtered: FilteredSampling::parse(config.word("PAGODA_GPU_SAMPLING_FILTERED"))
                    .unwrap_or(FilteredSampling::Fast),
                gumbel_max: config.on("PAGODA_GPU_SAMPLING_GUMBEL_MAX"),
                list_rounds: config.on("PAGODA_GPU_SAMPLING_LIST_ROUNDS"),
                cluster: config.on("PAGODA_GPU_SAMPLING_CLUSTER"),
                cluster_prefetch: config.on("PAGODA_GPU_SAMPLING_PREFETCH"),
            },
            deterministic: config.on("PAGODA_DETERMINISTIC"),
            kv_fp8: config.word("PAGODA_CACHE_TYPE_K") == "fp8"
                || config.word("PAGODA_CACHE_TYPE_V") == "fp8"
                || config.word("PAGODA_KV_CACHE_DTYPE") != "auto",
        }
    }

    /// The fused decode's partial kernel for `dtype` and `head_dim` when the configuration
    /// forces one (`None`: auto, the tuning table or the heuristic decides per bucket).
    pub fn decode_kernel(
        &self,
        dtype: DType,
        head_dim: usize,
    ) -> Result<Option<ops::PagedDecodeKernel>, CudaError> {
        let bf16 = dtype == DType::BF16;
        let mma_ok = bf16 && ops::PAGED_DECODE_MMA_HEAD_DIMS.contains(&head_dim);
        let tiling = ops::StreamTiling::ALL[0];
        let refuse = |name: &str| {
            Err(CudaError::invalid(format!(
                "PAGODA_PAGED_DECODE_KERNEL={name} needs bf16 and head_dim in {:?} (have \
                 {dtype}, {head_dim})",
                ops::PAGED_DECODE_MMA_HEAD_DIMS
            )))
        };
        if self.kv_fp8 {
            // The CUDA-core and streaming kernels read fp8; `Auto` takes the heuristic's
            // (streaming where it is built, the tuning table being bf16's).
            return match self.decode {
                DecodeKernelChoice::Auto => Ok(None),
                DecodeKernelChoice::CudaCore => Ok(Some(ops::PagedDecodeKernel::CudaCore)),
                DecodeKernelChoice::Streaming if bf16 && tiling.fits(head_dim) => {
                    Ok(Some(ops::PagedDecodeKernel::Streaming(tiling)))
                }
                DecodeKernelChoice::Streaming => refuse("stream"),
                DecodeKernelChoice::TensorCore => Err(CudaError::invalid(
                    "PAGODA_PAGED_DECODE_KERNEL=mma: an fp8 KV cache decodes on cuda-core or \
                     stream",
                )),
            };
        }
        match self.decode {
            DecodeKernelChoice::Auto => Ok(None),
            DecodeKernelChoice::Streaming if bf16 && tiling.fits(head_dim) => {
                Ok(Some(ops::PagedDecodeKernel::Streaming(tiling)))
            }
            DecodeKernelChoice::Streaming => refuse("stream"),
            DecodeKernelChoice::TensorCore if mma_ok => {
                Ok(Some(ops::PagedDecodeKernel::TensorCore))
            }
            DecodeKernelChoice::TensorCore => refuse("mma"),
            DecodeKernelChoice::CudaCore => Ok(Some(ops::PagedDecodeKernel::CudaCore)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(env: &[(&str, &str)]) -> pagoda_config::Config {
        let lookup = |name: &str| {
            env.iter()
                .find(|(key, _)| *key == name)
                .map(|(_, value)| value.to_string())
        };
        pagoda_config::Config::resolve(lookup, Vec::new(), &[]).unwrap()
    }

    #[test]
    fn the_defaults_are_the_registry_defaults() {
        assert_eq!(
            CudaKernels::from_config(&config(&[])),
            CudaKernels::default()
        );
    }

    #[test]
    fn every_setting_reaches_its_field() {
        let kernels = CudaKernels::from_config(&config(&[
            ("PAGODA_CUDA_PREFILL", "reference"),
            ("PAGODA_CUDA_PREFILL_TILING", "64x32x2"),
            ("PAGODA_CUDA_FUSED_ROPE_APPEND", "off"),
            ("PAGODA_CUDA_MIXED_STEPS", "prefill"),
            ("PAGODA_CUDA_PIECEWISE_TOKENS", "32"),
            ("PAGODA_CUDA_GEMV", "on"),
            ("PAGODA_CUDA_QUANT_GEMV_ROWS", "3"),
            ("PAGODA_CUDA_QUANT_MMA_ROWS", "16"),
            ("PAGODA_CUDA_QUANT_GEMV_KERNEL", "groups"),
            ("PAGODA_CUDA_QUANT_FUSED_Q8", "on"),
            ("PAGODA_CUDA_QUANT_PAIR", "on"),
            ("PAGODA_CUDA_MOE_MMA", "on"),
            ("PAGODA_CUDA_MOE_QUANT", "on"),
            ("PAGODA_CUDA_MOE_QUANT_DENSE_ROWS", "64"),
            ("PAGODA_PAGED_DECODE_KERNEL", "cuda-core"),
            ("PAGODA_PAGED_DECODE_MERGE", "kernel"),
            ("PAGODA_PAGED_DECODE_TARGET_CTAS", "100"),
            ("PAGODA_PAGED_DECODE_CHUNK", "4"),
            ("PAGODA_GPU_SAMPLING_FILTERED", "exact"),
            ("PAGODA_GPU_SAMPLING_GUMBEL_MAX", "off"),
            ("PAGODA_GPU_SAMPLING_LIST_ROUNDS", "off"),
            ("PAGODA_GPU_SAMPLING_CLUSTER", "off"),
            ("PAGODA_GPU_SAMPLING_PREFETCH", "off"),
            ("PAGODA_DETERMINISTIC", "on"),
            ("PAGODA_CASCADE_ATTENTION", "off"),
            ("PAGODA_CUDA_SPARSE_SELECT", "bitwise"),
            ("PAGODA_CUDA_FP8_GEMM", "off"),
            ("PAGODA_CUDA_FP8_GEMV_ROWS", "16"),
        ]));
        let expected = CudaKernels {
            prefill: PrefillKernel::PerToken,
            prefill_tiling: Some(ops::PrefillStreamTiling::new(64, 32, 2)),
            fused_rope_append: false,
            mixed_split: false,
            piecewise_tokens: 32,
            gemv: true,
            quant_gemv_rows: 3,
            quant_mma_rows: 16,
            quant_gemv_kernel: ops::QuantGemvKernel::Groups,
            quant_fused_q8: true,
            quant_pair: true,
            fp8_gemm: false,
            fp8_gemv_rows: 16,
            moe_mma: true,
            moe_quant: true,
            moe_quant_dense_rows: 64,
            decode: DecodeKernelChoice::CudaCore,
            merge: Some(MergeMode::InKernel),
            target_ctas: Some(100),
            pages_per_chunk: Some(4),
            cascade: None,
            sparse_decode: false,
            sparse_select: ops::SparseSelectKernels::Bitwise,
            sampling: SamplingKernels {
                filtered: FilteredSampling::Exact,
                gumbel_max: false,
                list_rounds: false,
                cluster: false,
                cluster_prefetch: false,
            },
            deterministic: true,
            kv_fp8: false,
        };
        assert_eq!(kernels, expected);
        let mma = CudaKernels {
            decode: DecodeKernelChoice::TensorCore,
            ..expected
        };
        assert!(mma.decode_kernel(DType::F32, 64).is_err());
        assert_eq!(
            mma.decode_kernel(DType::BF16, 64).unwrap(),
            Some(ops::PagedDecodeKernel::TensorCore)
        );
        let stream = CudaKernels {
            decode: DecodeKernelChoice::Streaming,
            ..expected
        };
        assert!(stream.decode_kernel(DType::F16, 128).is_err());
        assert!(matches!(
            stream.decode_kernel(DType::BF16, 128),
            Ok(Some(ops::PagedDecodeKernel::Streaming(_)))
        ));
        let auto = CudaKernels::default();
        assert_eq!(auto.decode_kernel(DType::BF16, 128).unwrap(), None);
        let fp8 = CudaKernels {
            kv_fp8: true,
            ..auto
        };
        assert_eq!(fp8.decode_kernel(DType::BF16, 128).unwrap(), None);
        assert_eq!(
            CudaKernels {
                decode: DecodeKernelChoice::CudaCore,
                ..fp8
            }
            .decode_kernel(DType::BF16, 128)
            .unwrap(),
            Some(ops::PagedDecodeKernel::CudaCore)
        );
        assert!(matches!(
            CudaKernels {
                decode: DecodeKernelChoice::Streaming,
                ..fp8
            }
            .decode_kernel(DType::BF16, 128),
            Ok(Some(ops::PagedDecodeKernel::Streaming(_)))
        ));
        assert!(CudaKernels {
            decode: DecodeKernelChoice::TensorCore,
            ..fp8
        }
        .decode_kernel(DType::BF16, 128)
        .is_err());
    }

    /// The registry's tiling words are exactly the kernel's tilings.
    #[test]
    fn the_tiling_setting_lists_every_tiling() {
        let words: Vec<String> = ops::PrefillStreamTiling::ALL
            .iter()
            .map(|t| t.to_string())
            .collect();
        for word in &words {
            let kernels =
                CudaKernels::from_config(&config(&[("PAGODA_CUDA_PREFILL_TILING", word)]));
            assert_eq!(
                kernels.prefill_tiling.map(|t| t.to_string()).as_ref(),
                Some(word)
            );
        }
        let setting = pagoda_config::setting("PAGODA_CUDA_PREFILL_TILING").unwrap();
        match setting.values {
            pagoda_config::Values::Choice(choices) => {
                assert_eq!(choices[0], "auto");
                assert_eq!(&choices[1..], words.as_slice());
            }
            _ => panic!("a choice"),
        }
    }
}
