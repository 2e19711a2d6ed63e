//! One module per subcommand.

pub mod bench;
pub mod bench_attention;
mod bench_attention_mla;
pub mod bench_cascade;
pub mod bench_kernels;
mod bench_moe;
mod bench_moe_quant;
mod bench_moe_table;
mod bench_quant_gemv;
pub mod bench_sampling;
pub mod bench_sampling_anchors;
pub mod bench_sampling_gpu;
pub mod bench_serve;
mod bench_sparse;
pub mod chat;
pub mod config;
mod decode_rig;
pub mod dynamo_worker;
pub mod generate;
mod host;
pub mod inspect;
pub mod serve;
mod stats;
pub mod tune;
mod tune_race;
pub mod tune_sampling;
